"""Group sizes: which ones a model's quantized linears take, and which one to use when none is given.

One rule for the VRAM planner (`llmopt.planning.vram`) and for `llmopt quantize` (`llmopt.quant`):
planning may not import quant, so the rule lives here, below both, and the plan and the checkpoint
cannot disagree about a model's group size.

Groups run along a linear's input dimension. For a set of input widths, a group size is valid when
it is -1 (one scale per output channel) or a multiple of GROUP_SIZE_MULTIPLE (8) that divides every
width:

* it divides every width because the kernels (Marlin, Machete, exllama, tinygemm) and both formats
  we write index a column's scale as `column // group_size`: a ragged last group has none;
* it is a multiple of 8 because int4 codes are packed eight to an int32 along the input, so a group
  that starts inside a packed word would split the word between two scales (and smaller groups
  spend more memory on scales than any kernel gains from them).

Multiples of 32 are marked in the error as the int4 kernels' sizes (tinygemm runs 32/64/128/256
natively and splits larger multiples of 32, see `llmopt.quant.linear.INT4_KERNEL_GROUPS`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

from llmopt.errors import LlmoptError

GROUP_SIZE_MULTIPLE = 8
INT4_KERNEL_MULTIPLE = 32
# int4 group sizes to use when the user gives none: the first valid one for every quantized width
W4_DEFAULT_GROUPS = (128, 64, 32)


def valid_group_sizes(widths: Iterable[int]) -> list[int]:
    """Positive group sizes valid for every width: the multiples of 8 that divide their gcd."""
    g = math.gcd(*widths)
    return [d for d in range(GROUP_SIZE_MULTIPLE, g + 1, GROUP_SIZE_MULTIPLE) if g % d == 0]


def is_valid_group_size(widths: Iterable[int], group_size: int) -> bool:
    """-1 (per channel), or a multiple of 8 that divides every width."""
    if group_size == -1:
        return True
    return group_size > 0 and group_size % GROUP_SIZE_MULTIPLE == 0 and all(w % group_size == 0 for w in widths)


def check_group_size(widths: Mapping[str, int], group_size: int) -> None:
    """Raise a one-line LlmoptError unless `group_size` is valid for every width in `widths`
    (name -> input width; the names are what the message calls them), listing the valid sizes."""
    if is_valid_group_size(widths.values(), group_size):
        return
    if group_size <= 0 or group_size % GROUP_SIZE_MULTIPLE:
        problem = f"is not a positive multiple of {GROUP_SIZE_MULTIPLE}"
    else:
        name, width = next((n, w) for n, w in widths.items() if w % group_size)
        problem = f"does not divide the input width {width} of {name}"
    first: dict[int, str] = {}  # each distinct width, under the first name that has it
    for name, width in widths.items():
        first.setdefault(width, name)
    shown = f" (input widths: {', '.join(f'{n} {w}' for w, n in first.items())})" if len(first) > 1 else ""
    sizes = valid_group_sizes(widths.values())
    fast = [g for g in sizes if g % INT4_KERNEL_MULTIPLE == 0]
    fast_hint = f" (multiples of {INT4_KERNEL_MULTIPLE} for the int4 kernels: {_join(fast)})" if fast else ""
    raise LlmoptError(
        f"group size {group_size} {problem}{shown}; "
        f"valid group sizes: {_join(sizes) or 'none'}{fast_hint}, or -1 (per channel)"
    )


def default_group_size(widths: Iterable[int], preferred: int = W4_DEFAULT_GROUPS[0]) -> int | None:
    """`preferred` when it is valid for every width, else the first of W4_DEFAULT_GROUPS (128, 64,
    32) that is; None when none is: only -1 fits, and whether to fall back to per channel or to ask
    the user is the caller's choice."""
    ws = list(widths)
    return next((g for g in (preferred, *W4_DEFAULT_GROUPS) if is_valid_group_size(ws, g)), None)


def _join(sizes: Iterable[int]) -> str:
    return ", ".join(map(str, sizes))
