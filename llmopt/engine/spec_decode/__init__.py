"""Speculative decoding inside the continuous-batching engine.

A proposer suggests k draft tokens per running sequence; the target model scores the last real token
plus the drafts in ONE forward pass (a k+1-token chunk over the paged cache, batched with everything
else in the step); the verifier keeps the longest acceptable prefix plus one token from the target.
KV slots written for rejected drafts are simply not counted as computed, so they are overwritten
later and never enter the prefix cache.

- `config.py`: SpeculativeConfig.
- `ngram.py`: prompt lookup, no extra model.
- `model_proposer.py`: `layer_skip` (the target's first layers) and `draft` (a separate model).
- `verifier.py`: greedy identity and rejection sampling, exact under structured outputs.
- `speculator.py`: the component the engine calls: propose after a step (for the next), record.
- `state.py`: the per-sequence SpecState and the engine-wide SpecCounters.

Speculation is skipped per request when its running acceptance rate falls below a threshold, and for
the whole step when the batch is large enough that verification costs more than it saves.
"""

from llmopt.engine.spec_decode.config import SpeculativeConfig
from llmopt.engine.spec_decode.ngram import ngram_propose
from llmopt.engine.spec_decode.state import SpecCounters, SpecState
from llmopt.engine.spec_decode.verifier import verify

__all__ = ["SpecCounters", "SpecState", "SpeculativeConfig", "ngram_propose", "verify"]
