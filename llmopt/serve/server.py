"""run_server: uvicorn with a graceful drain, the library function behind `llmopt serve`.

On SIGTERM (or Ctrl-C) the server stops admitting (new requests get 503, /health says 503 so load
balancers move away) but keeps listening while in-flight requests finish, for up to `drain_timeout_s`;
what is still running then is aborted (streams end with finish_reason "abort" and `[DONE]`), and only
then does uvicorn close its sockets. A second signal skips the wait; a third exits at once. The process
exits 0 after a drain: uvicorn's habit of re-raising the signal afterwards is not followed.
"""

from __future__ import annotations

import logging
import socket
import sys
import time
from types import FrameType

import uvicorn

from llmopt.engine.config import EngineConfig
from llmopt.errors import LlmoptError
from llmopt.serve.app import build_app, build_state
from llmopt.serve.config import ServerConfig
from llmopt.serve.state import ServerState

log = logging.getLogger("llmopt.serve")

_ANY_HOST = ("0.0.0.0", "::", "")


def bind_warning(host: str, api_keys: list[str]) -> str | None:
    """A warning for servers reachable from the network without any key."""
    if host in _ANY_HOST and not api_keys:
        return (f"listening on all interfaces ({host or '*'}) without --api-key: anyone who can reach this "
                "port can use the model; add --api-key or bind 127.0.0.1")
    return None


def listen_socket(host: str, port: int) -> socket.socket:
    """A bound TCP socket for uvicorn to serve on (port 0: any free one). Bound before the engine is built, so
    an address in use or a host that does not resolve is one line and exit 2 at once; uvicorn's own bind
    failure calls sys.exit while the engine's thread runs, and the process aborted."""
    try:
        found = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError) as e:
        raise LlmoptError(f"cannot listen on {host}:{port}: {e}") from None
    # IPv4 first where a name has both (`localhost` on some systems lists ::1 first; clients try 127.0.0.1)
    family, kind, proto, _, addr = min(found, key=lambda info: info[0] != socket.AF_INET)
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
    except OSError as e:
        sock.close()
        raise LlmoptError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sock


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, state: ServerState):
        super().__init__(config)
        self.state = state
        self._signals = 0
        self._hurry = False
        self._drain_started: float | None = None
        self._aborted = False

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:  # runs in the signal handler
        self._signals += 1
        if self._signals == 1:
            self.state.draining = True
        elif self._signals == 2:
            self._hurry = True
        else:
            self.force_exit = True
            self.should_exit = True

    def request_drain(self) -> None:
        """Start the drain without a signal (tests, embedding)."""
        self.state.draining = True

    def stop_now(self) -> None:
        self.should_exit = True

    async def on_tick(self, counter: int) -> bool:
        st = self.state
        if st.draining and not self.should_exit:
            now = time.monotonic()
            if self._drain_started is None:
                self._drain_started = now
                log.info("draining: %d request(s) in flight, up to %.0f s", len(st.engine_loop.active),
                         st.config.drain_timeout_s)
            if not st.engine_loop.active:
                self.should_exit = True
            elif not self._aborted and (self._hurry or now - self._drain_started >= st.config.drain_timeout_s):
                log.info("drain time is up: aborting %d request(s)", len(st.engine_loop.active))
                st.engine_loop.abort_all("abort")
                self._aborted = True
        return await super().on_tick(counter)


def make_server(engine_config: EngineConfig, config: ServerConfig, model_name: str) -> DrainingServer:
    """Build the app and its uvicorn server without running it."""
    state = build_state(engine_config, config, model_name)
    holder: list[DrainingServer] = []
    app = build_app(state, on_fatal=lambda: holder[0].stop_now())
    ucfg = uvicorn.Config(app, host=config.host, port=config.port, log_level=config.log_level,
                          timeout_graceful_shutdown=5, access_log=config.log_level == "debug")
    server = DrainingServer(ucfg, state)
    holder.append(server)
    return server


def run_server(engine_config: EngineConfig, config: ServerConfig, model_name: str | None = None) -> None:
    """Serve until SIGTERM/SIGINT; raises LlmoptError (exit 2) when the engine cannot start."""
    from llmopt.models.resolve import resolve_model

    logging.basicConfig(level=config.log_level.upper(), format="%(levelname)s:     %(message)s", stream=sys.stderr)
    resolved = resolve_model(engine_config.model)  # fail fast, before binding, on a bad MODEL
    if config.semantic_cache == "similar":
        from llmopt.serve.semantic_cache import embedder_dir

        embedder_dir()  # and on a missing embedding model
    name = config.served_model_name or model_name or engine_config.model or resolved.source
    warning = bind_warning(config.host, config.api_keys)
    if warning:
        log.warning(warning)
    sock = listen_socket(config.host, config.port)
    try:
        server = make_server(engine_config, config, name)
        server.run(sockets=[sock])
    finally:
        sock.close()
    if server.state.fatal is not None:
        raise LlmoptError(f"the engine failed to start: {server.state.fatal}")
