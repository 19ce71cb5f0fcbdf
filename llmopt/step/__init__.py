"""The decode step as one component: a model's decoder layers lowered once to a flat program of kernel
calls (`lowering.py`, `program.py`) and run by one native call per step (`decode_step.py`), so that no
Python runs per layer (docs/ARCHITECTURE.md, "The decode step")."""

from llmopt.step.decode_step import DecodeStep

__all__ = ["DecodeStep"]
