"""Choosing settings by measuring them: quantization searches that run real evaluations (above both
`quant` and `eval`, which must not import each other's upper half)."""
