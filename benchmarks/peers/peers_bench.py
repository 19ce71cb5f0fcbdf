"""`llmopt bench` with one difference: the `ignore_eos` extension is sent to every server, not only ours.

    python benchmarks/peers/peers_bench.py --url http://127.0.0.1:8000 --input-len 32:512 ... (= llmopt bench ARGS)

`llmopt bench --url` sends `ignore_eos` only when /v1/models says the server is llmopt's (strict servers reject
unknown fields), and has no flag to force it. vLLM and llama.cpp's server both accept it, and without it
they stop at EOS while ours generates exactly max_tokens: different work for the same requests. So the peer
harness runs the real `llmopt bench` CLI (same options, same report) with `send_ignore_eos=True` forced.
`run_peers.py` also checks that every server produced the same number of output tokens.

Second difference: a request that failed with "Server disconnected without sending a response" (httpx
RemoteProtocolError before any byte came back) is sent once more. llama-server (cpp-httplib) closes a
keep-alive connection after a few requests, and the client may already have picked that connection for the
next request: that request was never seen by the server, so it is not a server failure. The first quick run
(docs/BENCHMARKS.md, Peers) predates this and counted 1-2 of 8 llama.cpp requests per level as failed.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def patched_http(original):  # noqa: ANN001, ANN201 - wraps BenchOptions._http
    """BenchOptions._http that sends ignore_eos (as --ignore-eos/--no-ignore-eos say) to any server."""

    def _http(self):  # noqa: ANN001, ANN202
        return original(self).model_copy(update={"send_ignore_eos": self.ignore_eos})

    _http.peers_forced = True  # type: ignore[attr-defined]
    return _http


STALE = "without sending a response"


def retrying_send(original):  # noqa: ANN001, ANN201 - wraps HttpTarget.send
    """HttpTarget.send that resends once a request the server closed the connection on before answering."""

    async def send(self, req):  # noqa: ANN001, ANN202
        rec = await original(self, req)
        if not rec.success and rec.error_code == "protocol_error" and STALE in (rec.error or ""):
            rec = await original(self, req)
        return rec

    send.peers_forced = True  # type: ignore[attr-defined]
    return send


def force_ignore_eos() -> None:
    from llmopt.bench.config import BenchOptions

    if not getattr(BenchOptions._http, "peers_forced", False):
        BenchOptions._http = patched_http(BenchOptions._http)  # type: ignore[method-assign]
    from llmopt.bench.http_target import HttpTarget

    if not getattr(HttpTarget.send, "peers_forced", False):
        HttpTarget.send = retrying_send(HttpTarget.send)  # type: ignore[method-assign]


def main(argv: list[str] | None = None) -> None:
    force_ignore_eos()
    from llmopt.cli import main as cli_main

    sys.argv = ["llmopt", "bench", *(sys.argv[1:] if argv is None else argv)]
    cli_main()


if __name__ == "__main__":
    main()
