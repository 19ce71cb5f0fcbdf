"""`--scheme auto --target-bits B` (issue #32): the budget allocation, the bits it counts, and the mixed
checkpoint it writes, which our engine and transformers load to the same logits."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from llmopt import LLM, SamplingParams
from llmopt.errors import LlmoptError
from llmopt.quant.auto import Option, _lower_hull, allocate, stored_bits
from llmopt.quant.recipe import QuantizeConfig, candidate_scheme
from tests.quant._pipeline_helpers import (
    KB_FACTS,
    assert_transformers_loads_export,
    calib_options,
    quantize_tiny,
)


def _opts(*points: tuple[str, float, float]) -> list[Option]:
    return [Option(name, None, bits, kl) for name, bits, kl in points]


def test_stored_bits_count_scales_and_zero_points():
    assert stored_bits(candidate_scheme("w4a16-g32"), 576) == 4.5
    assert stored_bits(candidate_scheme("w4a16-g128"), 1536) == 4.125
    assert stored_bits(candidate_scheme("w4a16-g32", symmetric=False), 576) == 4 + 20 / 32
    assert stored_bits(candidate_scheme("w8a16"), 64) == 8.25
    assert stored_bits(candidate_scheme("bf16"), 64) == 16


def test_the_hull_drops_dominated_and_concave_options():
    opts = _opts(("a", 4.125, 1.0), ("b", 4.5, 0.2), ("c", 4.25, 0.9), ("d", 8.0, 0.25), ("e", 16.0, 0.0))
    # c saves little for its bits (above the a-b segment), d costs more than b and damages more
    assert [o.candidate for o in _lower_hull(opts)] == ["a", "b", "e"]


def test_the_budget_goes_where_it_removes_the_most_damage():
    options = {"sensitive": _opts(("w4", 4.5, 10.0), ("w8", 8.25, 0.1)),
               "robust": _opts(("w4", 4.5, 0.2), ("w8", 8.25, 0.1))}
    weights = {"sensitive": 100, "robust": 100}
    choice = allocate(options, weights, target_bits=(4.5 + 8.25) / 2)
    assert choice["sensitive"].candidate == "w8" and choice["robust"].candidate == "w4"
    # more budget never predicts more damage, and the average never passes the budget
    last = math.inf
    for b in (4.5, 5.0, 6.0, 6.375, 7.0, 8.25, 9.0):
        c = allocate(options, weights, b)
        assert sum(c[m].bits * n for m, n in weights.items()) / 200 <= b + 1e-9
        kl = sum(o.kl for o in c.values())
        assert kl <= last
        last = kl
    assert last == pytest.approx(0.2)


def test_a_budget_below_every_candidate_is_refused():
    with pytest.raises(LlmoptError, match="below the cheapest candidates' 4.500 bits"):
        allocate({"m": _opts(("w4", 4.5, 1.0))}, {"m": 10}, 4.0)


def test_auto_writes_a_mixed_checkpoint_that_loads_the_same_everywhere(tiny_llama, tmp_path, monkeypatch):
    out = tmp_path / "auto"
    report, modules = quantize_tiny(monkeypatch, tiny_llama, out, scheme="auto", target_bits=10.0,
                                    candidates=["w4a16-g32", "w8a16", "bf16"], **calib_options())
    auto = report.auto
    assert auto is not None and auto["bits"] <= 10.0
    assert len(auto["modules"]) == 8 and len(auto["choices"]) >= 2
    assert math.isfinite(auto["measured_kl"]) and auto["measured_kl"] >= 0 and auto["predicted_kl"] > 0
    chosen = {m["module"]: m["choice"] for m in auto["modules"]}
    assert {qm.target.module for qm in modules.values()} == {m for m, c in chosen.items() if c != "bf16"}
    qcfg = json.loads((out / "config.json").read_text())["quantization_config"]
    assert len(qcfg["config_groups"]) == len(set(chosen.values()) - {"bf16"})  # one group per scheme
    assert "bf16" in chosen.values() and sorted(qcfg["ignore"]) == sorted(report.ignored)
    with safe_open(str(next(out.glob("*.safetensors"))), "pt") as st:
        for hf in [n for n in report.ignored if ".layers." in n]:  # a linear left float: in bf16, as counted
            assert st.get_tensor(f"{hf}.weight").dtype == torch.bfloat16, hf
    llm = LLM(str(out), dtype="float32", device="cpu")
    assert_transformers_loads_export(out, llm, modules)


def test_more_bits_measure_less_damage(tiny_llama, tmp_path, monkeypatch):
    kls = []
    for bits in (4.5, 8.25):
        report, _ = quantize_tiny(monkeypatch, tiny_llama, tmp_path / str(bits), scheme="auto", target_bits=bits,
                                  candidates=["w4a16-g32", "w8a16"], method="gptq", **calib_options())
        kls.append((report.auto["predicted_kl"], report.auto["measured_kl"]))
    assert kls[1][0] < kls[0][0] and kls[1][1] < kls[0][1]


def test_with_awq_each_candidate_is_measured_as_awq_quantizes_it(tiny_llama, tmp_path, monkeypatch):
    """--method awq measures a candidate's damage after AWQ's scale and clip searches, not after plain RTN
    (which ranked the linears for another quantizer): its int4 options predict less damage than RTN's."""
    kl = {}
    for method in ("rtn", "awq"):
        report, _ = quantize_tiny(monkeypatch, tiny_llama, tmp_path / method, scheme="auto", target_bits=4.5,
                                  candidates=["w4a16-g32", "w8a16"], method=method, **calib_options())
        kl[method] = {m["module"]: m["options"]["w4a16-g32"] for m in report.auto["modules"]}
    assert kl["awq"].keys() == kl["rtn"].keys()
    assert all(kl["awq"][m] != kl["rtn"][m] for m in kl["rtn"])
    assert sum(kl["awq"].values()) < 0.9 * sum(kl["rtn"].values())


def test_gptq_candidates_are_measured_with_the_quantizes_range_search(tiny_llama, tmp_path, monkeypatch):
    """The search quantizes each GPTQ candidate as the quantize will: with GPTQ's weighted range search by default
    and with min/max under --no-mse. It once measured every candidate with min/max while the quantize searched
    ranges, so it ranked the linears for another quantizer."""
    kl = {}
    for mse in (True, False):
        report, _ = quantize_tiny(monkeypatch, tiny_llama, tmp_path / str(mse), scheme="auto", target_bits=4.5,
                                  candidates=["w4a16-g32", "w8a16"], method="gptq", mse=mse, **calib_options())
        kl[mse] = {m["module"]: m["options"]["w4a16-g32"] for m in report.auto["modules"]}
    assert kl[True].keys() == kl[False].keys()
    assert all(kl[True][m] != kl[False][m] for m in kl[False])


def test_method_auto_measures_both_methods_and_takes_the_better(tiny_llama, tmp_path, monkeypatch):
    """--method auto: every int candidate of every linear is measured by GPTQ and by AWQ, and the choice takes
    the less damaging of the two at each size. On the tiny model GPTQ wins every linear, so the depth probes
    carry GPTQ's weights and the GPTQ options' predictions are --method gptq's own, exactly."""
    opts = {"scheme": "auto", "target_bits": 4.5, "candidates": ["w4a16-g32", "w8a16"], **calib_options()}
    gptq, _ = quantize_tiny(monkeypatch, tiny_llama, tmp_path / "gptq", method="gptq", **opts)
    both, modules = quantize_tiny(monkeypatch, tiny_llama, tmp_path / "auto", method="auto", **opts)
    assert both.settings["act_order"] is True  # the linears it gives GPTQ get GPTQ's default order
    single = {m["module"]: m["options"] for m in gptq.auto["modules"]}
    for m in both.auto["modules"]:
        kl = m["options"]
        assert set(kl) == {f"{c} {meth}" for c in ("w4a16-g32", "w8a16") for meth in ("gptq", "awq")}
        for c in ("w4a16-g32", "w8a16"):
            assert kl[f"{c} gptq"] == pytest.approx(single[m["module"]][c], rel=1e-6)
        candidate, method = m["choice"].split()
        other = "awq" if method == "gptq" else "gptq"
        assert kl[m["choice"]] <= kl[f"{candidate} {other}"]
        assert modules[m["module"]].method == method  # and the quantize ran the chosen method
    assert both.auto["measured_kl"] == pytest.approx(gptq.auto["measured_kl"], rel=1e-6)


def _with_salient_channels(src: Path, dst: Path) -> Path:
    """A copy of `src` whose layer-0 attention input has a few channels 10x the rest, as real models have:
    AWQ's scale search then scales them (on the plain random model no scaling may beat none, and then there
    is nothing to fold)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    f = next(dst.glob("*.safetensors"))
    tensors = load_file(f)
    tensors["model.layers.0.input_layernorm.weight"][:4] *= 10
    save_file(tensors, f, metadata={"format": "pt"})
    return dst


def test_method_auto_quantizes_each_linear_by_its_own_method(tiny_llama, tmp_path, monkeypatch):
    """A plan that gives some linears AWQ and the rest GPTQ (here set by hand on real measurements, to have a
    mix on the tiny model): AWQ's scales fold into the producers of the AWQ linears only, each linear is
    quantized by its method, and transformers loads the checkpoint to our engine's logits."""
    from llmopt.quant.auto import AutoPlan
    from llmopt.quant.pipeline import quantize_model

    tiny_llama = _with_salient_channels(tiny_llama, tmp_path / "src")
    opts = {"scheme": "auto", "target_bits": 4.5, "candidates": ["w4a16-g32", "w8a16"], "method": "auto",
            "device": "cpu", "forward_dtype": "float32", **calib_options()}
    plan = AutoPlan(4.5, {}, {})
    quantize_model(QuantizeConfig(model=str(tiny_llama), output=tmp_path / "first", **opts), plan=plan)
    awq = {"layers.0.self_attn.qkv_proj", "layers.1.mlp.down_proj"}
    for m, options in plan.options.items():
        for o in options:
            if o.method == "awq" and m in awq:
                o.kl = 0.0  # AWQ now looks best for these two
    out = tmp_path / "mixed"
    report, modules = quantize_tiny(monkeypatch, tiny_llama, out, plan=plan, **opts)
    assert {m: q.method for m, q in modules.items()} == {m: "awq" if m in awq else "gptq" for m in plan.options}
    with safe_open(str(next(out.glob("*.safetensors"))), "pt") as st, \
            safe_open(str(next(tiny_llama.glob("*.safetensors"))), "pt") as src:
        def changed(name: str) -> bool:
            return not torch.equal(st.get_tensor(name).float(), src.get_tensor(name).float())
        assert changed("model.layers.0.input_layernorm.weight")  # 1/s of layer 0's q|k|v scales
        assert not changed("model.layers.1.input_layernorm.weight")  # GPTQ: nothing folded
        assert not changed("model.layers.0.post_attention_layernorm.weight")
    llm = LLM(str(out), dtype="float32", device="cpu")
    assert_transformers_loads_export(out, llm, modules)


def test_method_auto_needs_scheme_auto(tmp_path):
    with pytest.raises(ValueError, match="--method auto"):
        QuantizeConfig(model="x", scheme="w4a16", method="auto", output=tmp_path / "q")


def test_auto_tokens_sets_the_damage_sample(tiny_llama, tmp_path, monkeypatch):
    """--auto-tokens N: the damage is measured on the first N calibration tokens (whole windows, at least one)."""
    report, _ = quantize_tiny(monkeypatch, tiny_llama, tmp_path / "q", scheme="auto", target_bits=4.5,
                              candidates=["w4a16-g32", "w8a16"], auto_tokens=128, **calib_options())
    assert report.auto["sample_tokens"] == 128  # two windows of 64


def test_depth_gains_size_the_prediction_like_the_measurement(tiny_llama, tmp_path, monkeypatch):
    """Each layer's depth probe measures what the later layers do to a change it makes; with those gains the
    predicted KL of an all-int4 plan is within 25% of the KL measured on the quantized model, and the last
    layer, with only the head after it, where the second-order formula holds, has a gain near 1."""
    report, _ = quantize_tiny(monkeypatch, tiny_llama, tmp_path / "q", scheme="auto", target_bits=4.5,
                              candidates=["w4a16-g32", "w8a16"], **calib_options())
    auto = report.auto
    assert len(auto["depth_gains"]) == 2 and all(g > 0 for g in auto["depth_gains"])
    assert auto["depth_gains"][-1] == pytest.approx(1.0, rel=0.25)
    assert auto["predicted_kl"] == pytest.approx(auto["measured_kl"], rel=0.25)


GATE_OPTIONS = {"scheme": "auto", "candidates": ["w4a16-g32", "w8a16", "bf16"], "eval_data": KB_FACTS,
                "eval_seq_len": 64, "device": "cpu", "forward_dtype": "float32", **calib_options()}


def test_the_gate_search_writes_the_smallest_budget_that_passes(tiny_llama, tmp_path):
    """On the tiny model all-int4 fails `kl_div<=0.002` and all-int8 passes (measured: 0.0089 and 0.00005),
    so the search bisects between them and writes a passing checkpoint below all-int8's bits."""
    from llmopt.tune.gate_search import quantize

    out = tmp_path / "gated"
    report = quantize(QuantizeConfig(model=str(tiny_llama), gate=["kl_div<=0.002"], output=out, **GATE_OPTIONS))
    trials = report.gate_search["trials"]
    assert trials[0]["passed"] and not trials[1]["passed"]  # the dearest budget, then the cheapest
    passing = [t for t in trials if t["passed"]]
    assert report.auto["bits"] == min(t["bits"] for t in passing) < trials[0]["bits"]
    assert all(g["value"] <= 0.002 for t in passing for g in t["gates"])
    saved = json.loads((out / "quantization_report.json").read_text())
    assert saved["gate_search"]["trials"] == trials and saved["output"] == str(out)
    assert not list(tmp_path.glob(".llmopt-gate-*"))  # the trials' directory is gone
    LLM(str(out), dtype="float32", device="cpu").generate(["The"], SamplingParams(max_tokens=2))


def test_when_no_budget_passes_nothing_is_written(tiny_llama, tmp_path):
    from llmopt.errors import GateFailed
    from llmopt.tune.gate_search import quantize

    out = tmp_path / "gated"
    with pytest.raises(GateFailed, match="no checkpoint passes kl_div<0: even 8.222 bits per weight fails"):
        quantize(QuantizeConfig(model=str(tiny_llama), gate=["kl_div<0"], output=out, **GATE_OPTIONS))
    assert list(tmp_path.iterdir()) == []


def test_a_gate_takes_what_eval_takes(tmp_path):
    cfg = QuantizeConfig(model="x", scheme="auto", gate=["kl_div<=0.05@95", "ppl_increase_pct<=3"],
                         eval_data=tmp_path / "held-out.txt", output=tmp_path / "q")
    assert cfg.gate == ["kl_div<=0.05@95", "ppl_increase_pct<=3"] and cfg.needs_data


def _head_entry(report) -> dict:
    return next(m for m in report.auto["modules"] if m["module"] == "lm_head")


def test_lm_head_auto_puts_the_head_in_the_budget(tiny_llama, tmp_path, monkeypatch):
    """`--lm-head auto`: the head (here tied: the embedding) is one more item of the knapsack, its weights in
    the budget. With the linears held float, a budget that cannot keep the head in bf16 rounds it to int8 or
    int4, the export writes that head group and our engine runs it; the head's KL is measured, not predicted,
    so with nothing else quantized it is the KL measured on the whole result."""
    options = {"candidates": ["bf16"], "lm_head": "auto", "scheme": "auto", **calib_options()}
    with pytest.raises(ValueError, match="a budget of 16 or more quantizes nothing"):  # bf16 everywhere
        QuantizeConfig(model=str(tiny_llama), target_bits=16.0, output=tmp_path / "full", **options)

    # the head is 28% of the tiny model's searched weights: 14 bits on average leave it at most int8
    out = tmp_path / "tight"
    report, modules = quantize_tiny(monkeypatch, tiny_llama, out, target_bits=14.0, **options)
    head = _head_entry(report)
    assert set(head["options"]) == {"bf16", "int8", "int4"}
    kl = head["options"]
    assert 0 == kl["bf16"] < kl["int8"] < kl["int4"]
    assert head["choice"] in ("int8", "int4") and report.auto["bits"] <= 14.0 and not modules
    assert report.head["module"] == "model.embed_tokens"
    assert report.deployment["schemes"][-1] == f"head-{head['choice']}-tied"
    assert report.auto["measured_kl"] == pytest.approx(head["predicted_kl"], rel=1e-3)
    qcfg = json.loads((out / "config.json").read_text())["quantization_config"]
    assert [g["targets"] for g in qcfg["config_groups"].values()] == [["model.embed_tokens"]]
    llm = LLM(str(out), dtype="float32", device="cpu", num_kv_blocks=16)
    assert type(llm.engine.model.embed_tokens).__name__ == "QuantizedEmbedding"
    assert len(llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))[0]
               .outputs[0].token_ids) == 3


def test_lm_head_auto_needs_scheme_auto(tmp_path):
    with pytest.raises(ValueError, match="--lm-head auto"):
        QuantizeConfig(model="x", scheme="w4a16", lm_head="auto", output=tmp_path / "q")


def test_gptq_is_fitted_on_windows_the_damage_is_not_measured_on(tiny_llama, tmp_path, monkeypatch):
    """With calibration windows beyond the damage sample, the search fits GPTQ's Hessians on the next windows as
    many, not on the sample that judges it: swapping those windows for others moves GPTQ's predictions, while
    RTN's, which fit nothing, stay the same (the sample is the same two windows in both runs)."""
    import llmopt.quant.pipeline as pipeline

    real = pipeline.sample_windows

    def reordered(order):
        def sample(*args, **kwargs):
            cs = real(*args, **kwargs)
            cs.windows = cs.windows[order]
            return cs
        return sample

    predictions = {}
    for method in ("gptq", "rtn"):
        for name, order in (("next", [0, 1, 2, 3, 4, 5]), ("other", [0, 1, 4, 5, 2, 3])):
            monkeypatch.setattr(pipeline, "sample_windows", reordered(order))
            report, _ = quantize_tiny(monkeypatch, tiny_llama, tmp_path / f"{method}-{name}", scheme="auto",
                                      target_bits=4.5, candidates=["w4a16-g32", "w8a16"], method=method,
                                      auto_tokens=128, **calib_options())
            assert report.auto["sample_tokens"] == 128
            predictions[method, name] = {m["module"]: m["options"] for m in report.auto["modules"]}
    assert predictions["rtn", "next"] == predictions["rtn", "other"]
    moved = [m for m in predictions["gptq", "next"]
             if predictions["gptq", "next"][m]["w4a16-g32"] != predictions["gptq", "other"][m]["w4a16-g32"]]
    assert len(moved) == len(predictions["gptq", "next"])
