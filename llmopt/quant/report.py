"""`quantization_report.json` and its rich summary: what was done, how long it took, what it cost.

Per module: the scheme, the method that actually ran, the relative weight error ‖Ŵ−W‖/‖W‖ and,
with calibration data, the relative output error ‖X(Ŵ−W)ᵀ‖/‖XWᵀ‖ on a sample of the module's real
inputs (after any AWQ/SmoothQuant scaling, which leaves XWᵀ unchanged). `deployment` says which tools
and vLLM backends run the checkpoint (llmopt/quant/deploy.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel
from rich.console import Console
from rich.table import Table

from llmopt._version import __version__
from llmopt.quant.deploy import describe
from llmopt.quant.sequential import QuantizedModule
from llmopt.units import format_bytes


class ModuleReport(BaseModel):
    module: str
    hf_names: list[str]
    scheme: str
    method: str
    weight_rel_err: float
    output_rel_err: float | None
    gptq_loss: float | None
    seconds: float

    @classmethod
    def of(cls, qm: QuantizedModule) -> ModuleReport:
        assert qm.target.scheme is not None
        return cls(module=qm.target.module, hf_names=list(qm.target.parts), scheme=qm.target.scheme.describe(),
                   method=qm.method, weight_rel_err=qm.weight_rel_err, output_rel_err=qm.output_rel_err,
                   gptq_loss=qm.gptq_loss, seconds=round(qm.seconds, 4))


class QuantReport(BaseModel):
    llmopt_version: str = __version__
    model: str
    output: str
    format: str
    settings: dict[str, Any]
    calibration: dict[str, Any] | None
    modules: list[ModuleReport]
    ignored: list[str]
    timings_s: dict[str, float]
    bytes_before: int
    bytes_after: int
    notes: list[str] = []
    deployment: dict[str, Any] = {}
    auto: dict[str, Any] | None = None  # --scheme auto: the budget, each linear's choice, predicted/measured KL
    gate_search: dict[str, Any] | None = None  # --scheme auto --gate: every budget tried and its eval
    head: dict[str, Any] | None = None  # --lm-head: the module quantized (a tied head's embedding), scheme, error

    def write(self, path: Path) -> None:
        path.write_text(self.model_dump_json(indent=2) + "\n")

    def render(self, console: Console) -> None:
        t = Table(title=f"quantized {self.model} → {self.output}", show_header=False)
        t.add_column(style="bold")
        t.add_column()
        t.add_row("scheme / method", f"{self.settings.get('scheme')} / {self.settings.get('method')} "
                  f"({self.format})")
        t.add_row("modules", f"{len(self.modules)} quantized, {len(self.ignored)} left as is")
        ratio = self.bytes_before / max(self.bytes_after, 1)
        t.add_row("size", f"{format_bytes(self.bytes_before)} → {format_bytes(self.bytes_after)} ({ratio:.2f}x smaller)")
        errs = [m.output_rel_err for m in self.modules if m.output_rel_err is not None]
        werrs = [m.weight_rel_err for m in self.modules]
        if errs:
            t.add_row("output error", f"mean {sum(errs) / len(errs):.4f}, max {max(errs):.4f} (relative, calib. inputs)")
        if werrs:
            t.add_row("weight error", f"mean {sum(werrs) / len(werrs):.4f}, max {max(werrs):.4f} (relative)")
        if self.head:
            h = self.head
            t.add_row("lm_head", f"{h['module']}: {h['scheme']}, weight error {h['weight_rel_err']:.4f} (relative), "
                      f"{format_bytes(h['bytes'])}")
        if self.auto:
            a = self.auto
            counts = ", ".join(f"{n} {c}" for c, n in sorted(a["choices"].items()))
            t.add_row("auto precision", f"{a['bits']:.3f} bits/weight (target {a['target_bits']:g}): {counts}")
            t.add_row("auto KL", f"predicted {a['predicted_kl']:.4g}, measured {a['measured_kl']:.4g} "
                      f"(nats/token, {a['sample_tokens']} calibration tokens)")
        if self.gate_search:
            for tr in self.gate_search["trials"]:
                t.add_row("gate search", f"{tr['bits']:.3f} bits/weight: {'pass' if tr['passed'] else 'fail'} ("
                          + "; ".join(f"{g['gate']} = {'n/a' if g['value'] is None else format(g['value'], '.4g')}"
                                      for g in tr["gates"]) + ")")
        for stage, s in self.timings_s.items():
            t.add_row(f"time: {stage}", f"{s:.1f} s")
        if self.deployment:
            for tool, line in describe(self.deployment):
                t.add_row(f"runs on {tool}", line)
            for note in self.deployment.get("notes", []):
                t.add_row("note", note)
        for note in self.notes:
            t.add_row("note", note)
        console.print(t)
