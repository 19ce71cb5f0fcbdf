"""The one group-size rule (`llmopt.group_size`): valid sizes, the one-line error, the default choice,
and the VRAM planner and `llmopt quantize` choosing the same size for the same model."""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Any

import pytest
import torch

import llmopt.group_size
from llmopt.errors import LlmoptError
from llmopt.group_size import check_group_size, default_group_size, is_valid_group_size, valid_group_sizes
from llmopt.models.registry import build_model
from llmopt.models.spec import ModelSpec
from llmopt.planning.memory import VramPlanOptions
from llmopt.planning.vram import quantized_in_features, resolve_dtypes
from llmopt.quant.recipe import QuantizeConfig
from llmopt.quant.targets import plan_targets

SMOLLM2 = {"hidden": 576, "attention": 576, "intermediate": 1536}


def _error(widths: dict[str, int], group_size: int) -> str:
    with pytest.raises(LlmoptError) as e:
        check_group_size(widths, group_size)
    msg = str(e.value)
    assert "\n" not in msg
    return msg


def test_valid_sizes_are_the_multiples_of_8_that_divide_every_width():
    assert valid_group_sizes([576, 1536]) == [8, 16, 24, 32, 48, 64, 96, 192]
    assert valid_group_sizes([4096, 14336]) == [8, 16, 32, 64, 128, 256, 512, 1024, 2048]
    assert valid_group_sizes([576]) == [g for g in range(8, 577, 8) if 576 % g == 0]
    assert valid_group_sizes([20]) == []  # no multiple of 8 divides 20: only -1 is left
    assert all(is_valid_group_size([576, 1536], g) for g in valid_group_sizes([576, 1536]))


def test_per_channel_is_always_valid():
    check_group_size({"odd": 20}, -1)
    check_group_size(SMOLLM2, -1)
    assert is_valid_group_size([20, 36], -1)


def test_check_passes_valid_sizes():
    for g in valid_group_sizes(SMOLLM2.values()):
        check_group_size(SMOLLM2, g)


def test_error_names_the_width_lists_valid_sizes_marks_int4_ones_and_offers_per_channel():
    msg = _error(SMOLLM2, 128)
    assert msg.startswith("group size 128 does not divide the input width 576 of hidden ")
    assert "(input widths: hidden 576, intermediate 1536)" in msg  # attention 576 is hidden's width again
    assert msg.endswith("valid group sizes: 8, 16, 24, 32, 48, 64, 96, 192 "
                        "(multiples of 32 for the int4 kernels: 32, 64, 96, 192), or -1 (per channel)")


def test_one_width_is_named_without_the_list_of_widths():
    msg = _error({"model.layers.0.mlp.down_proj": 1536}, 1000)
    assert "input width 1536 of model.layers.0.mlp.down_proj;" in msg and "input widths:" not in msg


def test_a_divisor_that_is_not_a_multiple_of_8_is_rejected():
    assert 576 % 36 == 0 and 1536 % 12 == 0
    assert "group size 36 is not a positive multiple of 8" in _error({"w": 576}, 36)
    assert "is not a positive multiple of 8" in _error(SMOLLM2, 12)


def test_no_valid_size_leaves_per_channel():
    msg = _error({"w": 20}, 16)
    assert msg.endswith("valid group sizes: none, or -1 (per channel)") and "int4 kernels" not in msg


def test_default_is_the_preferred_size_else_128_64_32_else_none():
    assert default_group_size([4096, 14336]) == 128
    assert default_group_size([576, 1536]) == 64
    assert default_group_size([512, 1568]) == 32  # 1568 = 32 * 49
    assert default_group_size([584]) is None  # 8 * 73: no default fits, only 8 or -1 would
    assert default_group_size([576, 1536], 192) == 192
    assert default_group_size([576, 1536], 256) == 64  # the preferred size does not divide: fall back
    assert default_group_size([576, 1536], 36) == 64  # nor is a divisor that is not a multiple of 8 kept
    assert default_group_size([20], -1) == -1


def test_the_rule_module_sits_below_planning_and_quant():
    """planning may not import quant, so the shared rule imports nothing of llmopt but its errors."""
    tree = ast.parse(Path(llmopt.group_size.__file__).read_text())
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert {m for m in imported if m.startswith("llmopt")} == {"llmopt.errors"}


# ---- the planner and quantize agree --------------------------------------------------------------------

def _llama(hidden: int, intermediate: int, heads: int) -> dict[str, Any]:
    return {"model_type": "llama", "num_hidden_layers": 2, "hidden_size": hidden, "num_attention_heads": heads,
            "num_key_value_heads": heads, "intermediate_size": intermediate, "vocab_size": 128,
            "torch_dtype": "bfloat16"}


MOE = {"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "num_hidden_layers": 2,
       "hidden_size": 512, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 64,
       "intermediate_size": 1536, "moe_intermediate_size": 96, "num_experts": 4, "num_experts_per_tok": 2,
       "mlp_only_layers": [0], "vocab_size": 128, "torch_dtype": "bfloat16"}


@pytest.mark.parametrize(("config", "expected"), [
    (_llama(1024, 4096, 16), 128),
    (_llama(512, 1536 + 64, 8), 64),  # 1600: 128 does not divide the MLP input
    (_llama(576, 1536, 9), 64),  # SmolLM2: nor the hidden size
    (_llama(512, 1568, 8), 32),
    (MOE, 32),  # the experts' input 96 (a dense layer 1536, attention 512)
], ids=["g128", "intermediate-1600", "smollm2", "g32", "moe-experts-96"])
def test_vram_plan_and_quantize_pick_the_same_default_group_size(config: dict[str, Any], expected: int):
    spec = ModelSpec.from_hf_config(config)
    planned = resolve_dtypes(spec, VramPlanOptions(weight_dtype="int4")).group_size
    targets, notes = plan_targets(build_model(spec, torch.bfloat16, device="meta"),
                                  QuantizeConfig(scheme="w4a16", output=Path("/nonexistent/out")))
    chosen = {t.scheme.weights.group_size for t in targets if t.scheme}
    assert planned == expected and chosen == {expected}
    # the same widths on both sides: the planner's model of the linears is the quantizer's
    assert set(quantized_in_features(spec).values()) == {t.in_features for t in targets if t.scheme}
    assert bool(notes) == (expected != 128) and all(re.search(rf"using {expected}$", n) for n in notes)
