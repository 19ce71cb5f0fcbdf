"""What a recipe may contain: one optional section per stage, each built from that command's own config.

A recipe section is the library config of its command (`VramPlanOptions`, `CalibrateConfig`,
`QuantizeConfig`, `EvalOptions`, `EngineConfig` + `ServerConfig`, `BenchOptions`) minus the fields the
runner fills in itself (the model each stage reads, the output directories inside the run directory),
so field names, defaults, bounds and choices are those of the CLI commands and cannot drift from them:
a field a command gains shows up here without an edit. The sections are built with `create_model`
from the library models' field definitions; validators are not copied (some check fields the section
does not have), because every section is also turned into the real library config during validation
(`llmopt.recipe.validate`), which runs all of the library's own checks before any work starts.

Differences from the library models, each for a reason:
- every section forbids unknown keys and accepts numbers for string fields (`input_len: 128`);
- `vram_plan.gpu_memory` takes `24GiB` like the CLI flag (the library field is bytes), and
  `vram_plan.gates` adds gates on the plan's numbers;
- `calibration.data` items may be `PATH[:WEIGHT]` strings (as on the CLI) or `{path, weight}` mappings;
- `serve.engine.speculative` is typed by the engine's own `SpeculativeConfig` (the engine takes a dict);
- `bench.concurrency` / `bench.request_rate` accept YAML lists (`[1, 2, 4]`) as well as `"1,2,4"`.
"""

from __future__ import annotations

import copy
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, create_model, field_validator, model_validator

from llmopt.bench.config import BenchOptions
from llmopt.calibrate.run import CalibrateConfig
from llmopt.calibrate.sources import DataSource
from llmopt.engine.config import EngineConfig
from llmopt.engine.spec_decode import SpeculativeConfig
from llmopt.eval.options import EvalOptions
from llmopt.planning.vram import VramPlanOptions
from llmopt.quant.recipe import QuantizeConfig
from llmopt.serve.config import ServerConfig

SECTION_CONFIG = ConfigDict(extra="forbid", coerce_numbers_to_str=True)

# Fields of each library config that the runner sets, so a recipe may not.
RUNNER_FIELDS: dict[str, frozenset[str]] = {
    "vram_plan": frozenset({"gpu_memory_bytes"}),
    "calibration": frozenset({"model", "output", "overwrite"}),
    "quantize": frozenset({"model", "output", "overwrite", "calib", "calib_data", "num_samples", "seq_len", "seed"}),
    "eval": frozenset({"model", "report", "html", "bisect_plot"}),
    "serve.engine": frozenset({"model"}),
    "serve.server": frozenset(),
    "bench": frozenset({
        # the target is the run's own model, in-process, with serve.engine's settings
        "url", "endpoint", "served_model", "api_key", "request_timeout", "send_ignore_eos", "tokenizer", "model",
        "dtype", "device",
        "max_num_seqs", "max_num_batched_tokens", "kv_cache_memory", "kv_cache_dtype", "prefix_caching", "threads",
        # outputs go to the run directory
        "json_path", "markdown_path", "plot_path", "html_path", "progress",
        # an A/B needs two targets; a recipe has one (CI.md gates a regression with `llmopt bench --ab`)
        "ab", "ab_order",
    }),
}


def library_section(name: str, library: type[BaseModel], doc: str, *, exclude: frozenset[str] = frozenset(),
                    fields: dict[str, Any] | None = None, validators: dict[str, Any] | None = None
                    ) -> type[BaseModel]:
    """A recipe section with `library`'s fields (definitions, defaults, bounds), minus `exclude`, plus `fields`."""
    defs: dict[str, Any] = {n: (f.annotation, copy.copy(f)) for n, f in library.model_fields.items()
                            if n not in exclude}
    defs.update(fields or {})
    return create_model(name, __config__=SECTION_CONFIG, __doc__=doc, __validators__=validators or {},
                        **defs)  # type: ignore[call-overload]


# ------------------------------------------------------------------------------------------- vram_plan

VramPlanSection = library_section(
    "VramPlanSection", VramPlanOptions,
    "The memory plan (`llmopt vram-plan`): fails the run early when the deployment does not fit.",
    exclude=RUNNER_FIELDS["vram_plan"],
    fields={
        "gpu_memory": (str, Field("24GiB", description="Memory per GPU: 24GiB, 24GB, 24G or bytes.")),
        "gates": (list[str], Field(default_factory=list, description="Extra gates on the plan's numbers, e.g. "
                                   "max_concurrent_sequences>=20 or free_bytes>=2e9.")),
    },
)

# ----------------------------------------------------------------------------------------- calibration

CalibrationSource = library_section(
    "CalibrationSource", DataSource, "One calibration source and its share of the mix.")


def _sources(cls: type, v: Any) -> Any:
    """`PATH[:WEIGHT]` strings (the CLI form) become {path, weight} mappings."""
    if isinstance(v, list):
        return [DataSource.parse(x).model_dump() if isinstance(x, str) else x for x in v]
    return v


CalibrationSection = library_section(
    "CalibrationSection", CalibrateConfig,
    "Calibration data and activation statistics (`llmopt calibrate`); quantize reads the result.",
    exclude=RUNNER_FIELDS["calibration"],
    fields={"data": (list[CalibrationSource], Field(  # type: ignore[valid-type]
        min_length=1, description="Sources: `PATH[:WEIGHT]` or {path, weight}; local paths are relative to "
        "the recipe file; anything else is a `datasets` name."))},
    validators={"_sources": field_validator("data", mode="before", json_schema_input_type=list[
        str | CalibrationSource])(_sources)},  # type: ignore[valid-type]
)

# -------------------------------------------------------------------------------------------- quantize

QuantizeSection = library_section(
    "QuantizeSection", QuantizeConfig,
    "Quantization (`llmopt quantize`); uses the calibration stage's statistics when there is one.",
    exclude=RUNNER_FIELDS["quantize"],
)

# ------------------------------------------------------------------------------------------------ eval

EvalSection = library_section(
    "EvalSection", EvalOptions,
    "Quality (`llmopt eval`) of the quantized model (or `model` without a quantize section), with gates.",
    exclude=RUNNER_FIELDS["eval"],
)

# ----------------------------------------------------------------------------------------------- serve

EngineSection = library_section(
    "EngineSection", EngineConfig,
    "Engine arguments of the served model; the bench stage and the serve smoke test run with them.",
    exclude=RUNNER_FIELDS["serve.engine"],
    fields={
        "kv_cache_memory": (str | None, Field(None, description="KV pool size: 2GiB, 512MiB or bytes.")),
        "speculative": (SpeculativeConfig | None, Field(None, description="Speculative decoding, e.g. "
                        "{method: ngram, num_speculative_tokens: 4}.")),
    },
)

ServerSection = library_section(
    "ServerSection", ServerConfig,
    "HTTP server settings of `llmopt serve` (admission, priorities, timeouts, API keys).",
    exclude=RUNNER_FIELDS["serve.server"],
)


class ServeSection(BaseModel):
    """How the model is served. Validated and recorded; a run starts a server only for `smoke: true`."""

    model_config = SECTION_CONFIG

    engine: EngineSection = Field(default_factory=EngineSection)  # type: ignore[valid-type]
    server: ServerSection = Field(default_factory=ServerSection)  # type: ignore[valid-type]
    smoke: bool = Field(False, description="Start the server on 127.0.0.1 briefly, send one completion, stop it.")


# ----------------------------------------------------------------------------------------------- bench

def _sweep(cls: type, v: Any) -> Any:
    """[1, 2, 4] or 4 -> "1,2,4" / "4", the CLI's sweep syntax that the bench library parses."""
    if isinstance(v, list):
        return ",".join(str(x) for x in v)
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return str(v)
    return v


BenchSection = library_section(
    "BenchSection", BenchOptions,
    "A benchmark (`llmopt bench`) of the quantized model in-process, with serve.engine's settings.",
    exclude=RUNNER_FIELDS["bench"],
    validators={"_sweep": field_validator("concurrency", "request_rate", mode="before",
                                          json_schema_input_type=str | int | float | list[int | float | str] | None
                                          )(_sweep)},
)

# ---------------------------------------------------------------------------------------------- recipe


class Recipe(BaseModel):
    """A reproducible optimization job: plan memory, calibrate, quantize, evaluate, (smoke-)serve, benchmark.

    Only `model` is required; each other section enables its stage. Stages run in the order of STAGES.
    """

    model_config = ConfigDict(extra="forbid", coerce_numbers_to_str=True)

    model: str = Field(description="Alias (smollm2-135m), Hugging Face model directory, config.json or .gguf; "
                       "relative paths are read from the recipe's folder (then the working directory).")
    description: str | None = Field(None, description="Free text, copied into the run summary.")
    vram_plan: VramPlanSection | None = None  # type: ignore[valid-type]
    calibration: CalibrationSection | None = None  # type: ignore[valid-type]
    quantize: QuantizeSection | None = None  # type: ignore[valid-type]
    eval: EvalSection | None = None  # type: ignore[valid-type]
    serve: ServeSection | None = None
    bench: BenchSection | None = None  # type: ignore[valid-type]

    @model_validator(mode="before")
    @classmethod
    def _empty_sections(cls, data: Any) -> Any:
        return empty_sections_filled(data)


def empty_sections_filled(data: Any) -> Any:
    """`eval:` with nothing under it is the section with every default, as `eval: {}` is: present, it
    enables its stage (YAML reads it as null, which silently skipped the stage)."""
    if not isinstance(data, dict):
        return data
    sections = set(Recipe.model_fields) - {"model", "description"}
    return {k: {} if k in sections and v is None else v for k, v in data.items()}


def recipe_json_schema() -> dict[str, Any]:
    """The JSON Schema of a recipe (`llmopt recipe schema`), for editors and CI linters."""
    schema = Recipe.model_json_schema()
    schema["title"] = "llmopt recipe"
    return schema
