"""The OpenAI-compatible server (`llmopt serve`): FastAPI + uvicorn over one engine thread.

Modules: config (ServerConfig), protocol (request schema), errors (OpenAI error shape), auth (API keys,
key priorities), limits (body size), admission (429/400 decisions), engine_loop (the engine thread),
prompts (tokenizing on the asyncio side), responses (OpenAI JSON and SSE), serving (the request
pipeline), metrics (Prometheus), warmup, app (routes, lifespan), server (uvicorn with a drain),
vllm_handoff (`--engine vllm`). See docs/SERVE.md.
"""

from __future__ import annotations

__all__ = ["ServerConfig", "run_server"]


def __getattr__(name: str):
    # lazy: importing the package must not pull FastAPI, uvicorn and torch for `llmopt --help`
    if name == "ServerConfig":
        from llmopt.serve.config import ServerConfig

        return ServerConfig
    if name == "run_server":
        from llmopt.serve.server import run_server

        return run_server
    raise AttributeError(name)
