"""The FastAPI application: routes, auth dependency, error handlers, body limit, and the engine lifespan.

The engine is built and warmed up on its own thread after the app starts listening, so /health can
answer 503 while that happens and 200 once it is done; requests before then get 503 with Retry-After.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from llmopt._version import __version__
from llmopt.engine.config import EngineConfig
from llmopt.engine.llm_engine import LLMEngine
from llmopt.models.tokenizer import load_tokenizer
from llmopt.serve.admission import AdmissionController
from llmopt.serve.auth import SCOPE_KEY, ApiKeyAuth, ApiKeyMiddleware
from llmopt.serve.config import ServerConfig
from llmopt.serve.engine_loop import EngineLoop
from llmopt.serve.errors import install_error_handlers
from llmopt.serve.limits import BodySizeLimit
from llmopt.serve.metrics import CONTENT_TYPE, ServerMetrics
from llmopt.serve.prompts import PromptBuilder
from llmopt.serve.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from llmopt.serve.semantic_cache import SemanticCache
from llmopt.serve.serving import OpenAIServing
from llmopt.serve.state import ServerState
from llmopt.serve.warmup import warm_up

log = logging.getLogger("llmopt.serve")
OWNER = "llmopt"  # `llmopt bench` sends the ignore_eos extension only to servers that say this


def build_state(engine_config: EngineConfig, config: ServerConfig, model_name: str) -> ServerState:
    metrics = ServerMetrics(model_name)
    admission = AdmissionController(metrics, max_waiting=config.max_waiting,
                                    max_queued_tokens=config.max_queued_tokens, retry_after_s=config.retry_after_s,
                                    degrade_waiting=config.degrade_waiting,
                                    degrade_min_priority=config.degrade_min_priority,
                                    block_size=engine_config.block_size)
    auth = ApiKeyAuth(config.api_keys, config.api_key_priorities)
    cache = SemanticCache(config.semantic_cache, ttl_s=config.semantic_cache_ttl_s,
                          threshold=config.semantic_cache_threshold, on_hit=metrics.cache_hit)
    holder: dict[str, ServerState] = {}

    def factory() -> LLMEngine:  # runs on the engine thread, before /health turns 200
        cache.load()
        engine = LLMEngine(engine_config)
        holder["state"].prompts = PromptBuilder(load_tokenizer(engine.weights_dir), engine.spec.vocab_size,
                                                engine.max_model_len)
        return engine

    loop = EngineLoop(factory, warmup=warm_up if config.warmup else None, stat_listeners=[metrics.on_step],
                      aging_s=config.priority_aging_s if config.enable_priorities else None,
                      is_degraded=lambda: admission.degraded, on_capacity=admission.set_capacity)
    state = ServerState(engine_config, config, model_name, metrics, admission, auth, loop, cache)
    holder["state"] = state
    return state


def build_app(state: ServerState, on_fatal: Callable[[], None] | None = None) -> FastAPI:
    """`on_fatal` is called (on the event loop) when the engine cannot start, to stop the server."""

    def on_ready() -> None:
        el = state.engine_loop
        if el.failure is not None:
            state.fatal = el.failure
            log.error("the engine failed to start: %s", el.failure)
            if on_fatal is not None:
                on_fatal()
            return
        state.ready = True
        eng = state.engine_loop.engine
        log.info("ready: serving %s on %s, %s, %s decode step", state.model_name, eng.device if eng else "?",
                 eng.threads.describe() if eng else "?", eng.decode_step_kind if eng else "?")

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        state.engine_loop.start(asyncio.get_running_loop(), on_ready)
        yield
        state.engine_loop.abort_all("abort")
        await asyncio.to_thread(state.engine_loop.stop, 10.0 if state.ready else 0.5)
        state.cache.close()

    app = FastAPI(title="llmopt", version="1", lifespan=lifespan, docs_url=None, redoc_url=None)
    install_error_handlers(app)
    app.add_middleware(BodySizeLimit, max_bytes=state.config.max_body_bytes)
    app.add_middleware(ApiKeyMiddleware, auth=state.auth)  # added last = runs first
    serving = OpenAIServing(state)

    def api_key(request: Request) -> str | None:
        return request.scope.get(SCOPE_KEY)

    @app.get("/health")
    async def health() -> Response:
        if state.ready and not state.draining:
            return JSONResponse({"status": "ok"})
        status = "draining" if state.draining else ("failed" if state.fatal else "starting")
        return JSONResponse({"status": status}, status_code=503)

    @app.get("/version")
    async def version() -> Response:  # vLLM's: clients and probes read the server's version here
        return JSONResponse({"version": __version__})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models() -> Response:
        max_len = state.prompts.max_model_len if state.prompts else None
        return JSONResponse({"object": "list", "data": [
            {"id": state.model_name, "object": "model", "created": state.created, "owned_by": OWNER,
             "root": state.engine_config.model or state.model_name, "max_model_len": max_len}]})

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await serving.completions(body, api_key(request), request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await serving.chat(body, api_key(request), request)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> Response:
        return await serving.tokenize(body)

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> Response:
        return await serving.detokenize(body)

    return app
