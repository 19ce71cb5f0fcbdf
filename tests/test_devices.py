"""llmopt.devices: device names as users and configs give them."""

from __future__ import annotations

import pytest
import torch

from llmopt.devices import free_memory, resolve_device
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
