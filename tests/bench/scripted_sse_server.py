"""A real (tiny) OpenAI-compatible streaming server on 127.0.0.1 for the HTTP client tests.

Plain asyncio sockets speaking HTTP/1.1 with chunked transfer encoding, in a background thread, so that
the client under test goes through real TCP, real HTTP framing and real SSE. Behaviour is chosen by the
request's `model` field.
"""

from __future__ import annotations

import asyncio
import json
import threading
from typing import Any

TTFT_DELAY = 0.05
TOKEN_DELAY = 0.02
USAGE_PROMPT_TOKENS = 7


class ScriptedSSEServer:
    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []
        self.prefix_hits = 0
        self.prefix_queries = 0
        self.dropped = 0  # requests answered by closing the connection (models drop_once, drop_always)
        self.loop = asyncio.new_event_loop()
        self.server: asyncio.AbstractServer | None = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    # --------------------------------------------------------------------------------------- plumbing

    def start(self) -> None:
        ready = threading.Event()

        def run() -> None:
            asyncio.set_event_loop(self.loop)
            self.server = self.loop.run_until_complete(asyncio.start_server(self._conn, "127.0.0.1", 0))
            self.port = self.server.sockets[0].getsockname()[1]
            ready.set()
            self.loop.run_forever()

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()
        assert ready.wait(5)

    def stop(self) -> None:
        async def close() -> None:
            assert self.server is not None
            self.server.close()
            for t in asyncio.all_tasks():
                if t is not asyncio.current_task():
                    t.cancel()

        asyncio.run_coroutine_threadsafe(close(), self.loop).result(5)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)

    async def _conn(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                line = await reader.readline()
                if not line:
                    break
                method, path, _ = line.decode().split(" ", 2)
                headers: dict[str, str] = {}
                while (h := await reader.readline()) not in (b"\r\n", b"\n", b""):
                    k, _, v = h.decode().partition(":")
                    headers[k.strip().lower()] = v.strip()
                body = await reader.readexactly(int(headers.get("content-length", "0")))
                await self._route(method, path, body, writer)
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.CancelledError):
            pass
        finally:
            writer.close()

    @staticmethod
    async def _plain(writer: asyncio.StreamWriter, status: str, body: str, ctype: str) -> None:
        data = body.encode()
        writer.write(f"HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {len(data)}\r\n\r\n".encode()
                     + data)
        await writer.drain()

    @staticmethod
    async def _chunk(writer: asyncio.StreamWriter, text: str) -> None:
        data = text.encode()
        writer.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        await writer.drain()

    # ----------------------------------------------------------------------------------------- routes

    async def _route(self, method: str, path: str, raw: bytes, writer: asyncio.StreamWriter) -> None:
        if method == "GET" and path == "/v1/models":
            await self._plain(writer, "200 OK", json.dumps({"object": "list", "data": [
                {"id": "tiny", "object": "model", "owned_by": "llmopt"}]}), "application/json")
            return
        if method == "GET" and path == "/metrics":
            text = (
                "# HELP llmopt:prefix_cache_hits Prompt tokens served from the prefix cache.\n"
                "# TYPE llmopt:prefix_cache_hits counter\n"
                f"llmopt:prefix_cache_hits_total{{model=\"tiny\"}} {self.prefix_hits}\n"
                "# HELP llmopt:prefix_cache_queries Prompt tokens looked up.\n"
                "# TYPE llmopt:prefix_cache_queries counter\n"
                f"llmopt:prefix_cache_queries_total{{model=\"tiny\"}} {self.prefix_queries}\n"
                "# HELP llmopt:num_requests_running Requests running.\n"
                "# TYPE llmopt:num_requests_running gauge\n"
                "llmopt:num_requests_running 0\n"
            )
            await self._plain(writer, "200 OK", text, "text/plain; version=0.0.4")
            return
        if method != "POST" or path not in ("/v1/completions", "/v1/chat/completions"):
            await self._plain(writer, "404 Not Found", '{"error": "not found"}', "application/json")
            return
        body = json.loads(raw)
        self.bodies.append(body)
        model = body.get("model", "tiny")
        if model == "drop_always" or (model == "drop_once" and not self.dropped):
            # what llama-server does to a request on a keep-alive connection it is closing: no response
            self.dropped += 1
            raise ConnectionResetError
        if model == "err500":
            await self._plain(writer, "500 Internal Server Error",
                              '{"error": {"message": "engine exploded"}}', "application/json")
            return
        if model == "err404":  # what vLLM answers for a model it does not serve
            await self._plain(writer, "404 Not Found", '{"error": {"message": "The model `err404` does not exist.", '
                              '"type": "NotFoundError", "code": 404}}', "application/json")
            return
        if model == "slow":
            await asyncio.sleep(5)
        self.prefix_queries += 10
        self.prefix_hits += 6
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
        await writer.drain()
        await self._stream(writer, body, chat=path.endswith("chat/completions"), model=model)
        writer.write(b"0\r\n\r\n")
        await writer.drain()

    async def _stream(self, writer: asyncio.StreamWriter, body: dict[str, Any], chat: bool, model: str) -> None:
        n = int(body["max_tokens"])
        per_chunk = 2 if model == "multi" else 1

        async def event(obj: Any) -> None:
            await self._chunk(writer, f"data: {json.dumps(obj)}\n\n")

        if chat:  # the role announcement comes before prefill is done, as llama.cpp's server does
            await event({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                      "finish_reason": None}]})
        await asyncio.sleep(TTFT_DELAY)
        sent = 0
        chunk_i = 0
        while sent < n:
            k = min(per_chunk, n - sent)
            sent += k
            last = sent == n
            if chat:
                choice: dict[str, Any] = {"index": 0, "delta": {"content": "ab" * k}}
            else:
                choice = {"index": 0, "text": "ab" * k}
            choice["finish_reason"] = "length" if last else None
            obj: dict[str, Any] = {"choices": [choice]}
            if model == "multi":
                obj["usage"] = {"prompt_tokens": USAGE_PROMPT_TOKENS, "completion_tokens": sent}
            if model == "midstream_error" and chunk_i == 1:
                await event({"error": {"message": "out of KV cache", "code": 500}})
                return
            if model == "garbage" and chunk_i == 1:
                await self._chunk(writer, "data: {not json\n\n")
                return
            await event(obj)
            chunk_i += 1
            if not last:
                await asyncio.sleep(TOKEN_DELAY)
        if model not in ("nousage",):
            await event({"choices": [], "usage": {"prompt_tokens": USAGE_PROMPT_TOKENS, "completion_tokens": n,
                                                  "total_tokens": USAGE_PROMPT_TOKENS + n}})
        await self._chunk(writer, ": keep-alive comment\n\ndata: [DONE]\n\n")
