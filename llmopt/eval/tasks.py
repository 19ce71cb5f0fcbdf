"""lm-evaluation-harness task YAMLs, read in their own format, and the prompts they define.

We accept the keys of lm-eval's `TaskConfig` that a local, declarative task uses (data files, splits,
doc_to_* templates, delimiters, few-shot settings, metrics, generation kwargs) and refuse, with one
line naming the key, both unknown keys (a typo would otherwise silently change the prompt) and known
keys whose behaviour we do not reproduce (Python hooks such as `process_docs`, filters, `gen_prefix`).
Harmless bookkeeping keys (`tag`, `metadata`, `task_alias`, decontamination settings) are accepted
and ignored. Data files are resolved relative to the YAML's folder, so a task folder can be moved.

Prompt construction follows lm-eval 0.4's `ConfigurableTask.fewshot_context` for plain-text
(non-chat) models: description + for each shot (question + target_delimiter + answer +
fewshot_delimiter) + question; continuations are target_delimiter + choice.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from random import Random
from typing import Any, Literal

import pydantic
import yaml
from pydantic import BaseModel, ConfigDict, NonNegativeInt, ValidationError

from llmopt.errors import LlmoptError
from llmopt.eval.templates import DocRenderer, Field

# lm-eval's default seed for the few-shot sampler (lm_eval.defaults.DEFAULT_OTHER_SEED)
FEWSHOT_SEED = 1234
# lm-eval's default max_gen_toks (HFLM) when generation_kwargs does not give one
DEFAULT_MAX_GEN_TOKS = 256

SUPPORTED_KEYS = frozenset({
    "task", "dataset_path", "dataset_name", "dataset_kwargs", "training_split", "validation_split",
    "test_split", "fewshot_split", "doc_to_text", "doc_to_target", "doc_to_choice", "description",
    "target_delimiter", "fewshot_delimiter", "fewshot_config", "num_fewshot", "metric_list", "output_type",
    "generation_kwargs", "repeats",
})
IGNORED_KEYS = frozenset({"tag", "task_alias", "metadata", "should_decontaminate", "doc_to_decontamination_query"})
# lm-eval TaskConfig keys whose behaviour (Python code, filters, prompt sources, chat prefixes) we refuse
UNSUPPORTED_KEYS = frozenset({
    "custom_dataset", "process_docs", "process_results", "doc_to_image", "doc_to_audio", "unsafe_code",
    "use_prompt", "filter_list", "gen_prefix",
})
METRICS = {"multiple_choice": ("acc", "acc_norm", "acc_bytes"), "generate_until": ("exact_match",)}
DEFAULT_METRICS = {"multiple_choice": ("acc", "acc_norm"), "generate_until": ("exact_match",)}
EXACT_MATCH_KWARGS = frozenset({"ignore_case", "ignore_punctuation", "ignore_numbers", "regexes_to_ignore"})


class MetricSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    metric: str
    aggregation: Literal["mean"] = "mean"
    higher_is_better: bool = True
    ignore_case: bool = False
    ignore_punctuation: bool = False
    ignore_numbers: bool = False
    regexes_to_ignore: list[str] | None = None


class GenerationKwargs(BaseModel):
    """generation_kwargs' types and ranges, checked when the task loads (the engine would refuse them only
    after the model loaded, without naming the task). Strict: a quoted "false" must not sample."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    until: str | list[str] = ""
    max_gen_toks: int = pydantic.Field(DEFAULT_MAX_GEN_TOKS, ge=1)
    do_sample: bool = False
    temperature: float = pydantic.Field(1.0, ge=0.0)
    top_p: float = pydantic.Field(1.0, gt=0.0, le=1.0)
    top_k: int | None = pydantic.Field(None, ge=-1)


GENERATION_KWARGS = frozenset(GenerationKwargs.model_fields)  # the keys a task may give


class TaskConfig(BaseModel):
    """The supported subset of lm-eval's TaskConfig, with lm-eval's defaults."""

    model_config = ConfigDict(extra="forbid")

    task: str
    dataset_path: Literal["json", "csv", "parquet"]
    dataset_name: str | None = None
    dataset_kwargs: dict[str, Any]
    training_split: str | None = None
    validation_split: str | None = None
    test_split: str | None = None
    fewshot_split: str | None = None
    doc_to_text: Any = None
    doc_to_target: Any = None
    doc_to_choice: Any = None
    description: str = ""
    target_delimiter: str = " "
    fewshot_delimiter: str = "\n\n"
    fewshot_config: dict[str, Any] | None = None
    num_fewshot: NonNegativeInt | None = None
    metric_list: list[MetricSpec] | None = None
    output_type: Literal["multiple_choice", "generate_until"] = "generate_until"
    generation_kwargs: dict[str, Any] | None = None
    repeats: Literal[1] = 1


@dataclass
class Request:
    """What one document asks of the model: a context and either continuations or a generation."""

    doc: dict[str, Any]
    context: str
    continuations: list[str] = field(default_factory=list)  # multiple_choice: delimiter + choice
    choices: list[str] = field(default_factory=list)
    gold: int | list[int] | str | list[str] = 0


@dataclass
class Task:
    name: str
    path: Path
    config: TaskConfig
    docs: list[dict[str, Any]]
    fewshot_docs: list[dict[str, Any]]
    renderer: DocRenderer
    metrics: list[MetricSpec]
    description: Field | None = None

    @property
    def output_type(self) -> str:
        return self.config.output_type

    @property
    def generation(self) -> dict[str, Any]:
        """generation_kwargs with lm-eval's defaults: until = [fewshot_delimiter], greedy."""
        g = dict(self.config.generation_kwargs or {})
        until = g.get("until", [self.config.fewshot_delimiter])
        g["until"] = [until] if isinstance(until, str) else list(until)
        g.setdefault("max_gen_toks", DEFAULT_MAX_GEN_TOKS)
        return g

    def requests(self, limit: int | None = None) -> list[Request]:
        """One request per eval doc (the first `limit`), with few-shot contexts sampled as lm-eval does."""
        cfg = self.config
        n_shot = cfg.num_fewshot or 0
        fs_cfg = cfg.fewshot_config or {}
        sampler = fs_cfg.get("sampler", "default")
        rnd = Random(FEWSHOT_SEED)
        fs_split = fs_cfg.get("split", cfg.fewshot_split)
        same_split = fs_split is not None and fs_split == cfg.test_split
        docs = self.docs[:limit] if limit else self.docs
        out = []
        for i, doc in enumerate(docs):
            shots = self._sample(n_shot, doc if same_split else None, sampler, rnd)
            out.append(self._request(i, doc, shots))
        return out

    def _sample(self, n: int, eval_doc: dict | None, sampler: str, rnd: Random) -> list[dict]:
        if n == 0:
            return []
        pool = self.fewshot_docs
        if sampler == "first_n":
            pool = [d for d in pool if d != eval_doc] if eval_doc is not None else pool
            if n > len(pool):
                raise LlmoptError(f"task {self.name}: num_fewshot {n} exceeds the {len(pool)} few-shot docs")
            return pool[:n]
        if n + (eval_doc is not None) > len(pool):
            raise LlmoptError(f"task {self.name}: num_fewshot {n} exceeds the {len(pool)} few-shot docs")
        if eval_doc is None:
            return rnd.sample(pool, n)
        res = [d for d in rnd.sample(pool, n + 1) if d != eval_doc][:n]
        if len(res) < n:
            res = rnd.sample([d for d in pool if d != eval_doc], n)
        return res

    def _answer_text(self, doc: dict) -> str:
        r = self.renderer
        a = r.doc_to_target(doc)
        c = r.doc_to_choice(doc) if r.choice is not None else None
        if c and isinstance(a, int):
            return c[a]
        if isinstance(a, list):
            return str(a[0])
        return str(a)

    def _request(self, index: int, doc: dict, shots: list[dict]) -> Request:
        cfg, r = self.config, self.renderer
        parts = []
        if self.description is not None:
            parts.append(self.description.render(doc) if not self.description.is_field(doc)
                         else str(doc[self.description.spec]))
        for shot in shots:
            q = r.doc_to_text(shot)
            if not isinstance(q, str):
                raise LlmoptError(f"task {self.name}: doc_to_text gave {type(q).__name__}; multiple-input "
                                  "tasks are not supported")
            parts.append(q + cfg.target_delimiter + self._answer_text(shot) + cfg.fewshot_delimiter)
        q = r.doc_to_text(doc)
        if not isinstance(q, str):
            raise LlmoptError(f"task {self.name}: doc_to_text gave {type(q).__name__}; multiple-input tasks "
                              "are not supported")
        context = "".join(parts) + q
        gold = r.doc_to_target(doc)
        if self.output_type == "multiple_choice":
            choices = r.doc_to_choice(doc)
            if not choices:  # nothing to pick from: scoring would take the argmax of nothing
                raise LlmoptError(f"task {self.name}: document {index} has no choices")
            return Request(doc, context, [cfg.target_delimiter + c for c in choices], choices,
                           _gold_index(self.name, gold, choices))
        if r.choice is not None:
            gold = r.doc_to_choice(doc)[gold]  # type: ignore[index]
        elif isinstance(gold, list):
            gold = [str(g) for g in gold]
        else:
            gold = str(gold)
        return Request(doc, context, gold=gold)


def _gold_index(task: str, gold: Any, choices: list[str]) -> int | list[int]:
    """lm-eval: an int index, a choice string, or a list of indices (multiple targets); -100 if invalid."""
    if isinstance(gold, list):
        return [g if isinstance(g, int) and g < len(choices) else -100 for g in gold]
    if isinstance(gold, bool):
        raise LlmoptError(f"task {task}: doc_to_target gave a boolean")
    if isinstance(gold, int):
        return gold if gold < len(choices) else -100
    if isinstance(gold, str):
        return choices.index(gold) if gold in choices else -100
    raise LlmoptError(f"task {task}: doc_to_target gave {type(gold).__name__}; expected an index or a choice")


class _TaskLoader(yaml.SafeLoader):
    """SafeLoader that turns lm-eval's `!function module.fn` tags into a marker we can refuse by name."""


def _function_tag(loader: yaml.SafeLoader, node: yaml.Node) -> dict[str, str]:
    return {"__function__": loader.construct_scalar(node)}  # type: ignore[arg-type]


_TaskLoader.add_constructor("!function", _function_tag)


def _read_yaml(path: Path, seen: tuple[Path, ...] = ()) -> dict[str, Any]:
    if not path.is_file():
        raise LlmoptError(f"task file {path} does not exist")
    try:
        data = yaml.load(path.read_text(encoding="utf-8"), Loader=_TaskLoader)  # noqa: S506 (safe subclass)
    except (OSError, UnicodeDecodeError) as e:
        raise LlmoptError(f"cannot read task file {path}: {e}") from None
    except yaml.YAMLError as e:
        raise LlmoptError(f"task file {path} is not valid YAML: {' '.join(str(e).split())}") from None
    if not isinstance(data, dict):
        raise LlmoptError(f"task file {path} must be a YAML mapping")
    include = data.pop("include", None)
    if include is not None:  # lm-eval's include: the including file's keys win
        inc = (path.parent / str(include)).resolve()
        if inc in seen:
            raise LlmoptError(f"task file {path}: include cycle through {inc}")
        base = _read_yaml(inc, (*seen, path.resolve()))
        base.update(data)
        data = base
    return data


def _check_keys(path: Path, data: dict[str, Any]) -> None:
    for key, value in data.items():
        if isinstance(value, dict) and "__function__" in value:
            raise LlmoptError(f"task file {path}: {key} uses !function (Python code), which llmopt does not run")
        if key in UNSUPPORTED_KEYS:
            raise LlmoptError(f"task file {path}: field {key!r} is an lm-eval feature llmopt does not support")
        if key not in SUPPORTED_KEYS and key not in IGNORED_KEYS:
            raise LlmoptError(f"task file {path}: unknown field {key!r}")


def _data_files(path: Path, cfg: TaskConfig) -> dict[str, list[Path]]:
    kw = dict(cfg.dataset_kwargs)
    files = kw.pop("data_files", None)
    if kw:
        raise LlmoptError(f"task file {path}: dataset_kwargs.{next(iter(kw))} is not supported (only data_files)")
    if files is None:
        raise LlmoptError(f"task file {path}: dataset_kwargs.data_files is required")
    if isinstance(files, (str, list)):
        files = {"train": files}  # the `datasets` convention for unnamed files
    if not isinstance(files, dict):
        raise LlmoptError(f"task file {path}: dataset_kwargs.data_files must be a path, a list or a mapping")
    out: dict[str, list[Path]] = {}
    for split, names in files.items():
        names = [names] if isinstance(names, str) else names
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise LlmoptError(f"task file {path}: data_files.{split} must be a path or a list of paths")
        out[str(split)] = [(path.parent / Path(n).expanduser()) for n in names]
    return out


def _read_records(file: Path, kind: str) -> list[dict[str, Any]]:
    if not file.is_file():
        raise LlmoptError(f"task data file {file} does not exist")
    try:
        if kind == "json":
            raw = file.read_text(encoding="utf-8")
            stripped = raw.lstrip()
            if stripped.startswith("["):
                rows = json.loads(raw)
            else:  # JSON lines: an error names the file's line (split at \n only, as `datasets` reads them)
                rows = []
                for n, line in enumerate(raw.split("\n"), 1):
                    if line.strip():
                        try:
                            rows.append(json.loads(line))
                        except json.JSONDecodeError as e:
                            raise LlmoptError(f"{file}:{n}: invalid JSON ({e.msg}, column {e.colno})") from None
        else:
            import pandas as pd

            frame = pd.read_csv(file) if kind == "csv" else pd.read_parquet(file)
            rows = frame.to_dict(orient="records")
    except json.JSONDecodeError as e:
        raise LlmoptError(f"{file}:{e.lineno}: invalid JSON ({e.msg}, column {e.colno})") from None
    except LlmoptError:
        raise
    except Exception as e:  # pandas/pyarrow parse errors
        raise LlmoptError(f"cannot read task data file {file}: {type(e).__name__}: "
                          f"{' '.join(str(e).split())[:200]}") from None
    if not all(isinstance(r, dict) for r in rows):
        raise LlmoptError(f"task data file {file}: every record must be an object")
    return rows


def load_task(path: str | Path) -> Task:
    """Read and validate an lm-eval task YAML and its local data; compile its templates."""
    p = Path(path).expanduser().resolve()
    data = _read_yaml(p)
    _check_keys(p, data)
    data = {k: v for k, v in data.items() if k not in IGNORED_KEYS}
    data.setdefault("task", p.stem)
    try:
        cfg = TaskConfig.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(x) for x in err["loc"])
        raise LlmoptError(f"task file {p}: field {loc}: {err['msg']}") from None
    name = cfg.task
    files = _data_files(p, cfg)
    splits = {s: [r for f in fs for r in _read_records(f, cfg.dataset_path)] for s, fs in files.items()}
    eval_split = next((s for s in (cfg.test_split, cfg.validation_split) if s is not None), None)
    if eval_split is None:
        raise LlmoptError(f"task file {p}: set test_split or validation_split")
    if eval_split not in splits:
        raise LlmoptError(f"task file {p}: split {eval_split!r} is not in data_files ({', '.join(splits)})")
    docs = splits[eval_split]
    if not docs:
        raise LlmoptError(f"task {name}: split {eval_split!r} has no documents")
    fs_cfg = cfg.fewshot_config or {}
    bad_fs = set(fs_cfg) - {"sampler", "split"}
    if bad_fs:
        raise LlmoptError(f"task file {p}: fewshot_config.{sorted(bad_fs)[0]} is not supported")
    if fs_cfg.get("sampler", "default") not in ("default", "first_n"):
        raise LlmoptError(f"task file {p}: fewshot_config.sampler must be default or first_n")
    fs_split = fs_cfg.get("split", cfg.fewshot_split)
    if fs_split is not None:
        if fs_split not in splits:
            raise LlmoptError(f"task file {p}: fewshot split {fs_split!r} is not in data_files")
        fewshot = splits[fs_split]
    else:  # lm-eval's preconfigured rule: training, then validation, then test docs
        fewshot = next((splits[s] for s in (cfg.training_split, cfg.validation_split, cfg.test_split)
                        if s is not None and s in splits), docs)
    if cfg.doc_to_text is None or cfg.doc_to_target is None:
        raise LlmoptError(f"task file {p}: doc_to_text and doc_to_target are required")
    if cfg.output_type == "multiple_choice" and cfg.doc_to_choice is None:
        raise LlmoptError(f"task file {p}: output_type multiple_choice needs doc_to_choice")
    renderer = DocRenderer(name, cfg.doc_to_text, cfg.doc_to_target, cfg.doc_to_choice)
    metrics = cfg.metric_list or [MetricSpec(metric=m) for m in DEFAULT_METRICS[cfg.output_type]]
    for m in metrics:
        if m.metric not in METRICS[cfg.output_type]:
            raise LlmoptError(f"task file {p}: metric {m.metric!r} is not supported for {cfg.output_type} "
                              f"(supported: {', '.join(METRICS[cfg.output_type])})")
    if cfg.generation_kwargs:
        if cfg.output_type != "generate_until":
            raise LlmoptError(f"task file {p}: generation_kwargs needs output_type generate_until")
        bad = set(cfg.generation_kwargs) - GENERATION_KWARGS
        if bad:
            raise LlmoptError(f"task file {p}: generation_kwargs.{sorted(bad)[0]} is not supported")
        try:
            GenerationKwargs.model_validate(cfg.generation_kwargs)
        except ValidationError as e:
            err = e.errors()[0]
            loc = ".".join(str(x) for x in err["loc"][:1])  # the key, not pydantic's union branch
            raise LlmoptError(f"task file {p}: field generation_kwargs.{loc}: {err['msg']}") from None
    description = Field(name, "description", cfg.description) if cfg.description else None
    task = Task(name, p, cfg, docs, fewshot, renderer, metrics, description)
    task.requests(limit=1)  # render the first document now: a template error stops before any model loads
    return task
