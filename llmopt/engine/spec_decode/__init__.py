"""Speculative decoding inside the continuous-batching engine.

A proposer drafts k tokens per running sequence; the target scores the last real token plus the drafts
in one k+1-token chunk of the step's batch; the verifier keeps the accepted prefix plus one target
token. Rejected drafts' KV slots are never counted as computed, so they are overwritten later.
`speculator.py` is what the engine calls; proposers are `ngram.py` and `model_proposer.py`
(layer_skip, draft); `state.py` holds the per-sequence state and the counters.

Only the config is exported here, so that configs (the engine's, `llmopt bench`'s) import it without torch: a
benchmark client against a server never imports torch (docs/BENCHMARKS.md, "The benchmark client's start").
The rest is imported from its own module.
"""

from llmopt.engine.spec_decode.config import SpeculativeConfig

__all__ = ["SpeculativeConfig"]
