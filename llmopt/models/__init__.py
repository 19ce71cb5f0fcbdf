"""The model layer: resolve a MODEL argument into a spec, and load weights into our implementation."""

from llmopt.models.resolve import ResolvedModel, resolve_model
from llmopt.models.spec import ModelSpec

__all__ = ["ModelSpec", "ResolvedModel", "resolve_model"]
