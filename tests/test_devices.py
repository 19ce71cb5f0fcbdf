"""llmopt.devices: device names as users and configs give them."""

from __future__ import annotations

import pytest
import torch

from llmopt.devices import FORWARD_DTYPES, forward_dtype, free_memory, onednn_supported, resolve_device
from llmopt.errors import LlmoptError


def test_auto_resolves_to_what_is_there():
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert resolve_device("cpu") == torch.device("cpu")


def test_unknown_device_is_a_user_error():
    with pytest.raises(LlmoptError, match="unknown device"):
        resolve_device("tpu")


@pytest.mark.parametrize("device", [None, "auto", "cpu", torch.device("cpu")])
def test_free_memory_takes_every_form_a_config_holds(device):
    """Engine configs keep `auto` (the recipe's serve smoke frees its engine with the config's device)."""
    free_memory(device)


def test_forward_dtype_auto_is_bf16_only_where_the_device_multiplies_it():
    """Calibration's and quantization's forwards: `auto` is bf16 on CUDA and on CPUs whose oneDNN multiplies bf16
    (AVX512-BF16, AMX), float32 on the others (torch's bf16 matmul ran 10x slower there); names are kept."""
    cpu = torch.device("cpu")
    assert forward_dtype("auto", cpu) == (torch.bfloat16 if onednn_supported(torch.bfloat16) else torch.float32)
    assert forward_dtype("auto", torch.device("cuda")) == torch.bfloat16
    for name, dtype in FORWARD_DTYPES.items():
        assert forward_dtype(name, cpu) == dtype
