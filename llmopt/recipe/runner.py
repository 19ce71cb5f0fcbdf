"""`llmopt run RECIPE.yaml`: validate everything, then run the recipe's stages in order into RUN_DIR,
skipping those whose inputs did not change.

Flow: validate (exit 2 on any problem, before any work) → plan (which stages run, which are skipped
because their key matches `state.json` and their artifact is intact, which upstream artifacts come
from earlier runs) → for each stage, build its artifacts in a temp directory that replaces
`RUN_DIR/<stage>` only on success (`llmopt.io.atomic_directory`), then record it in
`state.json` → write `summary.json` / `summary.md` (also after a failure, so CI can upload them).

Exit codes (`RunReport.exit_code`): 0 every gate passed; 1 a gate failed (named); 2 the recipe or an
input is invalid, or a stage failed on bad input. A gate failure does not stop later stages (their
measurements are still wanted), except the memory plan's: a model that does not fit stops the run.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import yaml
from rich.console import Console
from rich.markup import escape

from llmopt.devices import free_memory
from llmopt.errors import LlmoptError
from llmopt.io import atomic_directory, public_mode, write_json_atomic, write_text_atomic
from llmopt.recipe.hashing import changed_parts, stage_key, tree_fingerprint
from llmopt.recipe.issues import Issue, RecipeInvalid
from llmopt.recipe.lock import run_lock
from llmopt.recipe.resolved import ResolvedRecipe, resolved_document
from llmopt.recipe.stages import STAGES, Stage, StageContext
from llmopt.recipe.state import GateRecord, RunState, StageRecord, load_state, save_state
from llmopt.recipe.summary import RunReport, StageReport, write_summary
from llmopt.recipe.validate import validate_recipe

RESOLVED_RECIPE = "recipe.resolved.yaml"
VERSIONS = "versions.json"


@dataclass
class RunRequest:
    """The options of `llmopt run`."""

    recipe: str | Path
    out: str | Path | None = None  # default: runs/<recipe file name without suffix>
    stages: str | Sequence[str] | None = None
    overrides: Sequence[str] = ()
    dry_run: bool = False
    force: bool = False  # rerun selected stages even when unchanged
    env: Mapping[str, str] | None = None
    skip_gates: Sequence[str] = ()  # gates left out by metric or expression (skip_gates.py)


def default_run_dir(recipe: str | Path) -> Path:
    return Path("runs") / Path(recipe).stem


@dataclass
class _Plan:
    rr: ResolvedRecipe
    run_dir: Path
    enabled: list[Stage]
    selected: list[Stage]
    state: RunState
    # artifact fingerprints of stages not run now whose artifacts later stages read
    reused: dict[str, str] = field(default_factory=dict)


def _artifact_intact(run_dir: Path, name: str, record: StageRecord | None) -> bool:
    return record is not None and (run_dir / name).is_dir() and tree_fingerprint(run_dir / name) == record.artifact_hash


def _preflight(rr: ResolvedRecipe, selected: list[Stage]) -> None:
    """Problems only visible once the stages to run are known (before any of them starts)."""
    from llmopt.models.resolve import resolve_model

    weighted = [s.name for s in selected if s.needs_weights]
    if weighted and resolve_model(rr.model_ref).kind == "config":
        raise RecipeInvalid([rr.issue(("model",), f"{rr.model_ref} is only a config.json: enough for vram_plan, "
                                      f"but {', '.join(weighted)} need{'s' if len(weighted) == 1 else ''} the model's weights (point `model` at the "
                                      "model directory, or run --stages vram_plan)")])
    issues = []
    for s in selected:
        device = _setting(rr.recipe, s.device_key) if s.device_key else None
        if isinstance(device, str) and device.startswith("cuda"):
            import torch

            if not torch.cuda.is_available():
                issues.append(rr.issue(s.device_key, f"stage {s.name} asks for {device}, but torch "
                                       f"{torch.__version__} sees no CUDA GPU here (install the CUDA build of "
                                       "torch, see the README, or use device: auto)"))
    if issues:
        raise RecipeInvalid(_unique(issues))


def _setting(obj: object, path: tuple[str | int, ...]) -> object:
    for part in path:
        obj = getattr(obj, str(part), None)
    return obj


def _unique(issues: list[Issue]) -> list[Issue]:
    return list({i.format(): i for i in issues}.values())


def _plan(req: RunRequest) -> _Plan:
    rr, selected = validate_recipe(req.recipe, req.overrides, req.env, req.stages, req.skip_gates)
    _preflight(rr, selected)
    run_dir = Path(req.out) if req.out is not None else default_run_dir(req.recipe)
    enabled = [s for s in STAGES if s.enabled(rr)]
    plan = _Plan(rr, run_dir, enabled, selected, load_state(run_dir))
    names = {s.name for s in enabled}
    chosen = {s.name for s in selected}
    issues: list[Issue] = []
    for s in selected:
        for up in s.upstream(rr, names.__contains__):
            if up in chosen or up in plan.reused:
                continue
            record = plan.state.stages.get(up)
            if _artifact_intact(run_dir, up, record):
                assert record is not None
                plan.reused[up] = record.artifact_hash
            else:
                issues.append(Issue(f"stage {s.name!r} reads the output of stage {up!r}, which {run_dir} does not "
                                    f"hold (or it was modified); add {up} to --stages", source="--stages"))
    if issues:
        raise RecipeInvalid(issues)
    return plan


def _key(plan: _Plan, stage: Stage, artifact_hashes: dict[str, str]) -> tuple[str, dict[str, str]] | None:
    """The stage's key and its parts, or None while an upstream artifact it reads is still to be (re)built."""
    names = {s.name for s in plan.enabled}
    upstream = {}
    for up in stage.upstream(plan.rr, names.__contains__):
        if up not in artifact_hashes:
            return None
        upstream[up] = artifact_hashes[up]
    return stage_key(stage.name, stage.inputs(plan.rr), plan.rr.model_ref, upstream)


def _skip_reason(plan: _Plan, stage: Stage, key: tuple[str, dict[str, str]] | None, force: bool
                 ) -> tuple[bool, str]:
    """(skip?, why) for a selected stage."""
    record = plan.state.stages.get(stage.name)
    if force:
        return False, "--force"
    if record is None:
        return False, "no previous run"
    if key is None:
        return False, "an upstream stage runs first"
    if record.key != key[0]:
        return False, "inputs changed: " + (", ".join(changed_parts(record.key_parts, key[1])) or "key format")
    if not _artifact_intact(plan.run_dir, stage.name, record):
        return False, "artifact missing or modified"
    return True, f"unchanged since {record.finished_at}"


def _recorded(stage: Stage, record: StageRecord, status: str, reason: str) -> StageReport:
    return StageReport(stage.name, status, reason, 0.0 if status == "skipped" else None,  # type: ignore[arg-type]
                       dict(record.metrics), list(record.gates), stage.name + "/")


def _dry_run(plan: _Plan, req: RunRequest, started: str) -> RunReport:
    hashes = dict(plan.reused)
    stages = []
    for s in plan.enabled:
        if s not in plan.selected:
            stages.append(StageReport(s.name, "not_selected", "not in --stages"))
            continue
        key = _key(plan, s, hashes)
        skip, why = _skip_reason(plan, s, key, req.force)
        record = plan.state.stages.get(s.name)
        if skip and record is not None:
            hashes[s.name] = record.artifact_hash
            stages.append(_recorded(s, record, "would_skip", why))
        else:
            stages.append(StageReport(s.name, "would_run", f"{s.summary}: {why}"))
    return RunReport(str(req.recipe), str(plan.run_dir), plan.rr.recipe.description, stages, started, dry_run=True,
                     skipped_gates=plan.rr.skipped_gates)


def _header(console: Console, i: int, n: int, stage: Stage) -> None:
    console.rule(f"[bold]stage {i}/{n}: {stage.name}[/] [dim]· {stage.summary}[/]")


def _write_run_files(plan: _Plan, req: RunRequest) -> None:
    from llmopt.recipe.environment import versions

    plan.run_dir.mkdir(parents=True, exist_ok=True)
    header = [f"# resolved from {req.recipe}", "# (defaults filled in, ${VAR}s expanded, paths absolute)"]
    header += [f"# --set {o}" for o in req.overrides]
    body = yaml.safe_dump(resolved_document(plan.rr), sort_keys=False, allow_unicode=True)
    write_text_atomic(plan.run_dir / RESOLVED_RECIPE, "\n".join(header) + "\n" + body)
    write_json_atomic(plan.run_dir / VERSIONS, versions())


def _run_stage(plan: _Plan, stage: Stage, key: tuple[str, dict[str, str]], ctx: StageContext, why: str
               ) -> tuple[StageReport, StageRecord]:
    t0 = time.perf_counter()
    try:
        with atomic_directory(plan.run_dir / stage.name, overwrite=True) as tmp:
            outcome = stage.run(ctx, tmp)
            for p in [tmp, *tmp.rglob("*")]:
                public_mode(p)
    finally:
        # a stage's models (eval's two engines, the serve smoke's) can sit in reference cycles; collect them
        # before the next stage loads its own, or a 7B run holds two models at once on a 24 GiB machine
        free_memory("auto")
    duration = time.perf_counter() - t0
    gates = [GateRecord.of(g) for g in outcome.gates]
    record = StageRecord(key=key[0], key_parts=key[1], artifact_hash=tree_fingerprint(plan.run_dir / stage.name),
                         finished_at=datetime.now(UTC).isoformat(timespec="seconds"), duration_s=duration,
                         metrics=outcome.metrics, gates=gates, halt=outcome.halt)
    report = StageReport(stage.name, "ran", outcome.halt or why, duration, outcome.metrics, gates, stage.name + "/")
    return report, record


def run_recipe(req: RunRequest, console: Console | None = None) -> RunReport:
    """Validate, plan and run (or with `dry_run`, only plan) the recipe; see the module docstring."""
    console = console or Console(stderr=True)
    started = datetime.now(UTC).isoformat(timespec="seconds")
    t_start = time.perf_counter()
    plan = _plan(req)
    if req.dry_run:
        return _dry_run(plan, req, started)
    with run_lock(plan.run_dir):
        return _execute(plan, req, console, started, t_start)


def _execute(plan: _Plan, req: RunRequest, console: Console, started: str, t_start: float) -> RunReport:
    """The run itself, under the run folder's lock."""
    _write_run_files(plan, req)
    report = RunReport(str(req.recipe), str(plan.run_dir), plan.rr.recipe.description, [], started,
                       skipped_gates=plan.rr.skipped_gates)
    hashes = dict(plan.reused)
    ctx = StageContext(plan.rr, plan.run_dir, console,
                       artifacts={name: plan.run_dir / name for name in plan.reused})
    halted: str | None = None
    n = len(plan.selected)
    try:
        for s in plan.enabled:
            if s not in plan.selected:
                report.stages.append(StageReport(s.name, "not_selected", "not in --stages"))
                continue
            if halted is not None:
                report.stages.append(StageReport(s.name, "not_run", halted))
                continue
            _header(console, plan.selected.index(s) + 1, n, s)
            key = _key(plan, s, hashes)
            assert key is not None  # upstream stages of this run have finished by now
            skip, why = _skip_reason(plan, s, key, req.force)
            record = plan.state.stages.get(s.name)
            if skip and record is not None:
                console.print(f"[cyan]skipped[/] {s.name}: {why} (artifacts in {escape(str(plan.run_dir / s.name))})")
                stage_report = _recorded(s, record, "skipped", why)
            else:
                console.print(f"[dim]running {s.name}: {why}[/]")
                t_stage = time.perf_counter()
                try:
                    stage_report, record = _run_stage(plan, s, key, ctx, why)
                except BaseException as e:
                    failed = StageReport(s.name, "failed", why, time.perf_counter() - t_stage, error=_one_line(e))
                    report.stages.append(failed)
                    raise
                plan.state.stages[s.name] = record
                save_state(plan.run_dir, plan.state)
                console.print(f"[green]✓[/] {s.name} ran in {stage_report.duration_s:.1f} s; artifacts in "
                              f"{escape(str(plan.run_dir / s.name))}", highlight=False)
            for g in stage_report.gates:
                color = "green" if g.passed else "red"
                console.print(f"[{color}]gate[/] {s.name}: {g.describe()}", highlight=False)
            report.stages.append(stage_report)
            hashes[s.name] = record.artifact_hash
            ctx.artifacts[s.name] = plan.run_dir / s.name
            if record.halt:
                halted = f"{s.name} stopped the run"
                console.print(f"[bold red]{s.name} stopped the run:[/] {escape(record.halt)}", highlight=False)
    except BaseException as e:
        _finish_after_failure(report, plan, t_start, e)
        raise _stage_error(report, e) from (None if isinstance(e, LlmoptError) else e)
    report.duration_s = time.perf_counter() - t_start
    write_summary(plan.run_dir, report)
    return report


def _one_line(e: BaseException) -> str:
    if isinstance(e, KeyboardInterrupt):
        return "interrupted"
    text = " ".join(str(e).split())
    return text if isinstance(e, LlmoptError) else f"{type(e).__name__}: {text}"


def _finish_after_failure(report: RunReport, plan: _Plan, t_start: float, e: BaseException) -> None:
    """Mark what did not run and write the summary, so CI still gets one."""
    done = {s.name for s in report.stages}
    failed = report.failed_stage
    for s in plan.enabled:
        if s.name not in done:
            reason = "not in --stages" if s not in plan.selected else f"{failed.name if failed else 'a stage'} failed"
            report.stages.append(StageReport(s.name, "not_selected" if s not in plan.selected else "not_run",
                                             reason))
    report.duration_s = time.perf_counter() - t_start
    write_summary(plan.run_dir, report)


def _stage_error(report: RunReport, e: BaseException) -> BaseException:
    """The error the CLI shows: one line naming the failed stage (bugs keep their traceback)."""
    failed = report.failed_stage
    if isinstance(e, LlmoptError) and failed is not None:
        err = LlmoptError(f"stage {failed.name} failed: {e}")
        err.exit_code = e.exit_code  # e.g. 130 for an interrupted benchmark
        return err
    return e
