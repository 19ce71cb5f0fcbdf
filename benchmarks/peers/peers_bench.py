"""`llmopt bench` with one difference: the `ignore_eos` extension is sent to every server, not only ours.

    python benchmarks/peers/peers_bench.py --url http://127.0.0.1:8000 --input-len 32:512 ... (= llmopt bench ARGS)

`llmopt bench --url` sends `ignore_eos` only when /v1/models says the server is llmopt's (strict servers reject
unknown fields), and has no flag to force it. vLLM and llama.cpp's server both accept it, and without it
they stop at EOS while ours generates exactly max_tokens: different work for the same requests. So the peer
harness runs the real `llmopt bench` CLI (same options, same report) with `send_ignore_eos=True` forced.
`run_peers.py` also checks that every server produced the same number of output tokens.
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


def force_ignore_eos() -> None:
    from llmopt.bench.config import BenchOptions

    if not getattr(BenchOptions._http, "peers_forced", False):
        BenchOptions._http = patched_http(BenchOptions._http)  # type: ignore[method-assign]


def main(argv: list[str] | None = None) -> None:
    force_ignore_eos()
    from llmopt.cli import main as cli_main

    sys.argv = ["llmopt", "bench", *(sys.argv[1:] if argv is None else argv)]
    cli_main()


if __name__ == "__main__":
    main()
