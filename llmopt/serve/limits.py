"""Request-body size limit as a pure ASGI middleware: 413 before the JSON parser sees a byte too many.

The body is read here, up to the limit, and replayed to the app. (Raising from a wrapped `receive`
would not work: FastAPI turns any error while reading the body into its own 400.) Past the limit the
rest of the body is read and dropped before answering 413, up to `DRAIN_FACTOR` times the limit: a
server that answers and closes while the client is still uploading makes the client's TCP stack see a
reset instead of the 413. Bodies larger still get the 413 and the connection is closed at once.
"""

from __future__ import annotations

import json
from typing import Any

from llmopt.serve.errors import error_body

DRAIN_FACTOR = 16


class BodySizeLimit:
    def __init__(self, app: Any, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def _too_large(self, receive, send, size: int, more: bool, drain: bool = True) -> None:
        """Drop what is left of the body (up to the drain cap), then answer 413."""
        while drain and more and size <= DRAIN_FACTOR * self.max_bytes:
            msg = await receive()
            if msg["type"] != "http.request":
                return
            size += len(msg.get("body", b""))
            more = msg.get("more_body", False)
        body = json.dumps(error_body(f"request body larger than {self.max_bytes} bytes",
                                     "invalid_request_error", None, "request_too_large")).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        if more:  # still uploading past the cap: do not keep this connection
            headers.append((b"connection", b"close"))
        await send({"type": "http.response.start", "status": 413, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope.get("headers", ()):
            if name == b"content-length" and (not value.isdigit() or int(value) > DRAIN_FACTOR * self.max_bytes):
                await self._too_large(receive, send, 0, True, drain=False)  # not worth reading: answer, close
                return
        chunks: list[bytes] = []
        size = 0
        while True:
            msg = await receive()
            if msg["type"] != "http.request":  # the client left before sending the body
                return
            chunk = msg.get("body", b"")
            size += len(chunk)
            more = msg.get("more_body", False)
            if size > self.max_bytes:
                await self._too_large(receive, send, size, more)
                return
            chunks.append(chunk)
            if not more:
                break
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()  # afterwards: http.disconnect, for disconnect detection

        await self.app(scope, replay, send)
