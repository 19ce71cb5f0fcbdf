"""Quality evaluation: perplexity, lm-eval-format tasks, baseline-vs-candidate comparison and gates.

Every number here is computed through the llmopt engine itself (`engine.scoring.iter_logits` for
teacher-forced scoring, `LLM.generate` for generation), so a quantized checkpoint or an INT8 KV cache
is measured exactly as it will be served. lm-eval-harness is used only as an optional cross-check
(`harness_lmeval`). See docs/EVAL.md.
"""

from __future__ import annotations
