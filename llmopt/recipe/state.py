"""`RUN_DIR/state.json`: what each stage of the last runs produced, so unchanged stages can be skipped.

Per stage: the key its inputs hashed to, the fingerprint of the artifact directory it wrote, when and
how long it ran, and what it measured (metrics and gates), so a skipped stage still reports its
results. A stage's record is written only after its artifact directory is in place, and the file is
replaced atomically, so a crash never leaves a record pointing at a half-written artifact.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field, ValidationError

from llmopt.gates import GateResult, IntervalGateResult
from llmopt.io import write_json_atomic

STATE_FILE = "state.json"
STATE_VERSION = 1


class GateRecord(BaseModel):
    gate: str
    metric: str
    value: float | None
    passed: bool
    detail: str | None = None  # a confidence gate's own account: point, interval, verdict, what would decide it

    @classmethod
    def of(cls, r: GateResult) -> GateRecord:
        if isinstance(r, IntervalGateResult):
            return cls(gate=r.expression, metric=r.gate.metric, value=r.value, passed=r.passed, detail=r.describe())
        return cls(gate=r.gate.expression, metric=r.gate.metric, value=r.value, passed=r.passed)

    def describe(self) -> str:
        if self.detail:
            return self.detail
        measured = "not measured" if self.value is None else f"measured {self.value:.4g}"
        return f"{'PASS' if self.passed else 'FAIL'} {self.gate} ({measured})"

    def failure(self) -> str:
        """`gate (measured 3.1)`, or a confidence gate's own account (`NOT SHOWN acc_drop<=2@95 (...)`)."""
        return self.detail or f"{self.gate} ({'not measured' if self.value is None else f'measured {self.value:.4g}'})"


class StageRecord(BaseModel):
    key: str
    key_parts: dict[str, str] = Field(default_factory=dict)  # see hashing.stage_key: says what changed
    artifact_hash: str
    finished_at: str
    duration_s: float
    metrics: dict[str, Any] = Field(default_factory=dict)
    gates: list[GateRecord] = Field(default_factory=list)
    halt: str | None = None


class RunState(BaseModel):
    version: int = STATE_VERSION
    stages: dict[str, StageRecord] = Field(default_factory=dict)


def load_state(run_dir: Path) -> RunState:
    """The recorded state; an unreadable or older file counts as no state (every stage reruns)."""
    path = run_dir / STATE_FILE
    if not path.is_file():
        return RunState()
    try:
        state = RunState.model_validate_json(path.read_text())
    except (OSError, ValidationError, ValueError):
        return RunState()
    return state if state.version == STATE_VERSION else RunState()


def save_state(run_dir: Path, state: RunState) -> None:
    write_json_atomic(run_dir / STATE_FILE, state.model_dump(mode="json"))
