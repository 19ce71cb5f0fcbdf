"""Engine and server configs of the recipe's `serve` section, shared by the serve smoke test and bench.

One place turns `serve.engine` into the `EngineConfig` every in-process engine of the run uses, so the
benchmark measures the engine exactly as the recipe would serve it (speculative decoding, prefix
caching, KV dtype, batch sizes).
"""

from __future__ import annotations

from typing import Any

from llmopt.engine.config import EngineConfig
from llmopt.recipe.issues import Issue
from llmopt.recipe.resolved import ResolvedRecipe
from llmopt.recipe.stages.base import build, model_fields
from llmopt.serve.config import ServerConfig


def engine_kwargs(rr: ResolvedRecipe) -> dict[str, Any]:
    serve = rr.recipe.serve
    if serve is None:
        return {}
    return serve.engine.model_dump()  # speculative becomes the dict EngineConfig takes


def engine_config(rr: ResolvedRecipe, model: str) -> EngineConfig:
    return EngineConfig(model=model, **engine_kwargs(rr))


def server_config(rr: ResolvedRecipe, **overrides: Any) -> ServerConfig:
    serve = rr.recipe.serve
    kw = serve.server.model_dump() if serve is not None else {}
    return ServerConfig(**{**kw, **overrides})


def serve_issues(rr: ResolvedRecipe) -> list[Issue]:
    """Problems with serve.engine / serve.server, located at their keys."""
    serve = rr.recipe.serve
    if serve is None:
        return []
    issues = build(rr, ("serve", "engine"), model_fields(type(serve.engine)),
                   lambda: engine_config(rr, rr.model_ref))[1]
    issues += build(rr, ("serve", "server"), model_fields(type(serve.server)), lambda: server_config(rr))[1]
    return issues
