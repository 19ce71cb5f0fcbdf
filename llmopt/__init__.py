"""llmopt: make LLMs cheaper and faster to run without making them dumber."""

from __future__ import annotations

from llmopt._version import __version__

__all__ = ["LLM", "SamplingParams", "__version__"]


def __getattr__(name: str):
    # Lazy: `llmopt --help` and `vram-plan` must not pay for importing torch.
    if name == "LLM":
        from llmopt.engine.llm import LLM

        return LLM
    if name == "SamplingParams":
        from llmopt.engine.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(name)
