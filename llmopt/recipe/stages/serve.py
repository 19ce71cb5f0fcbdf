"""The `serve` stage (only with `serve.smoke: true`): start the `llmopt serve` server on 127.0.0.1 with
the recipe's engine and server settings, wait until /health is 200, send one completion, stop it.

Why: it proves the artifact the recipe built loads and answers through the real HTTP stack (the same
`make_server` that `run_server` runs) without leaving a long-lived process behind. The server runs in
a thread of this process on an ephemeral port, like the serve tests do, so nothing can leak past the
stage, and the bench stage still measures the engine in-process.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

from llmopt.errors import LlmoptError
from llmopt.recipe.issues import Issue
from llmopt.recipe.resolved import ResolvedRecipe
from llmopt.recipe.stages.base import Stage, StageContext, StageOutcome
from llmopt.recipe.stages.serving import engine_config, engine_kwargs, serve_issues, server_config

SMOKE_PROMPT = "The three most important settings of an LLM server are"
SMOKE_MAX_TOKENS = 16
READY_TIMEOUT_S = 600.0
RESULT_FILE = "smoke.json"


class ServeStage(Stage):
    name = "serve"
    section = "serve"
    summary = "serve smoke test (llmopt serve, one request)"
    needs = ("quantize",)
    device_key = ("serve", "engine", "device")

    def enabled(self, rr: ResolvedRecipe) -> bool:
        return rr.recipe.serve is not None and rr.recipe.serve.smoke

    def check(self, rr: ResolvedRecipe) -> list[Issue]:
        return serve_issues(rr)

    def inputs(self, rr: ResolvedRecipe) -> dict[str, Any]:
        serve = rr.recipe.serve
        assert serve is not None
        return {"engine": engine_kwargs(rr), "server": serve.server.model_dump(mode="json"),
                "prompt": SMOKE_PROMPT, "max_tokens": SMOKE_MAX_TOKENS}

    def run(self, ctx: StageContext, out: Path) -> StageOutcome:
        try:
            import httpx

            from llmopt.serve.server import listen_socket, make_server
        except ImportError as e:
            raise LlmoptError(f"serve.smoke needs the serve extra ({e.name} is missing): "
                              "pip install -e '.[serve,bench]'") from None
        model = ctx.candidate_model()
        sock = listen_socket("127.0.0.1", 0)
        port = sock.getsockname()[1]
        cfg = server_config(ctx.rr, host="127.0.0.1", port=port, log_level="warning")
        name = cfg.served_model_name or "recipe-model"
        server = make_server(engine_config(ctx.rr, model), cfg, name)
        thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True, name="serve-smoke")
        base = f"http://127.0.0.1:{port}"
        headers = {"Authorization": f"Bearer {cfg.api_keys[0]}"} if cfg.api_keys else {}
        ctx.console.print(f"[dim]serving {model} on {base} for one request ...[/]")
        started = time.perf_counter()
        thread.start()
        try:
            ready_s = _wait_ready(base, thread, started, server.state)
            t0 = time.perf_counter()
            resp = httpx.post(f"{base}/v1/completions", headers=headers, timeout=cfg.request_timeout_s,
                              json={"model": name, "prompt": SMOKE_PROMPT, "max_tokens": SMOKE_MAX_TOKENS,
                                    "temperature": 0})
            latency_s = time.perf_counter() - t0
        finally:
            server.should_exit = True
            thread.join(60)
            sock.close()
        if resp.status_code != 200:
            raise LlmoptError(f"the server answered {resp.status_code} to the smoke request: {resp.text[:200]}")
        body = resp.json()
        text = body["choices"][0]["text"]
        usage = body.get("usage") or {}
        result = {"model": model, "ready_s": round(ready_s, 3), "latency_s": round(latency_s, 3),
                  "prompt": SMOKE_PROMPT, "text": text, "usage": usage,
                  "finish_reason": body["choices"][0].get("finish_reason")}
        (out / RESULT_FILE).write_text(json.dumps(result, indent=2) + "\n")
        ctx.console.print(f"200 OK in {latency_s * 1000:.0f} ms: {text!r}", highlight=False)
        return StageOutcome(metrics={"ready_s": result["ready_s"], "latency_ms": round(latency_s * 1000, 1),
                                     "completion_tokens": usage.get("completion_tokens")})


def _wait_ready(base: str, thread: threading.Thread, started: float, state: Any) -> float:
    """Seconds until /health turned 200 (engine loaded and warmed up)."""
    import httpx

    while time.perf_counter() - started < READY_TIMEOUT_S:
        if not thread.is_alive():
            why = state.fatal or "see the log above"
            raise LlmoptError(f"the server stopped before it became ready: {why}")
        try:
            if httpx.get(f"{base}/health", timeout=5).status_code == 200:
                return time.perf_counter() - started
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise LlmoptError(f"the server was not ready after {READY_TIMEOUT_S:.0f} s")
