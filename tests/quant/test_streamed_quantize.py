"""`quantize` streams the model layer by layer: the peak of live tensor bytes does not grow with the number of
layers, for every method, and an interrupted run leaves no output."""

from __future__ import annotations

import pytest
import torch
from _pipeline_helpers import calib_options

from llmopt import LLM, SamplingParams
from llmopt.models.reader import CheckpointTensors
from llmopt.quant.export import CheckpointExport
from llmopt.quant.pipeline import quantize_model
from llmopt.quant.recipe import QuantizeConfig
from llmopt.testing.live_bytes import LiveTensorBytes
from llmopt.testing.tiny_model import write_tiny_llama

LAYERS = 2
# wide enough that a decoder layer (~1 MB in fp32) outweighs the 512-token embedding (0.26 MB)
SHAPE = {"hidden_size": 128, "intermediate_size": 512, "num_heads": 4, "num_kv_heads": 2}

METHODS = {
    "w4a16-rtn": {"scheme": "w4a16", "group_size": 32},
    "w4a16-gptq-act-order": {"scheme": "w4a16", "group_size": 32, "method": "gptq", "act_order": True,
                             **calib_options()},
    "w4a16-awq": {"scheme": "w4a16", "group_size": 32, "method": "awq", **calib_options()},
    "w8a8-smoothquant-gptq": {"scheme": "w8a8", "method": "gptq", **calib_options()},
    "fp8": {"scheme": "fp8"},
    "w8a16-int8-kv": {"scheme": "w8a16", "kv_cache": "int8", **calib_options()},
}


@pytest.fixture(scope="module")
def shallow_and_deep(tmp_path_factory):
    root = tmp_path_factory.mktemp("depth")
    return (write_tiny_llama(root / "shallow", num_layers=LAYERS, **SHAPE),
            write_tiny_llama(root / "deep", num_layers=4 * LAYERS, **SHAPE))


def _peak(model, out, options) -> int:
    with LiveTensorBytes() as live:
        quantize_model(QuantizeConfig(model=str(model), output=out, device="cpu", forward_dtype="float32",
                                      **options))
    return live.peak


@pytest.mark.parametrize("name", list(METHODS))
def test_peak_tensor_memory_does_not_grow_with_depth(shallow_and_deep, tmp_path, name):
    """N and 4N layers of the same width: the same peak within 10%. Holding the model (as before streaming)
    would take 4x the layers' bytes: 3-4x the peak."""
    shallow, deep = shallow_and_deep
    a = _peak(shallow, tmp_path / "a", METHODS[name])
    b = _peak(deep, tmp_path / "b", METHODS[name])
    layer_bytes = 4 * (128 * (128 + 64 + 64) + 128 * 128 + 3 * 128 * 512)  # one fp32 layer's linears
    assert b <= 1.10 * a, f"{name}: peak {b / 1e6:.2f} MB with {4 * LAYERS} layers, {a / 1e6:.2f} MB with {LAYERS}"
    assert b < a + layer_bytes  # not even one more layer held


def test_an_interrupted_quantize_leaves_no_partial_output(shallow_and_deep, tmp_path, monkeypatch):
    """Ctrl-C after a layer went to disk: no output directory, no temporary files beside it."""
    real, done = CheckpointExport.add_layer, []

    def interrupt_second(self, model, index, modules):
        if done:
            raise KeyboardInterrupt
        done.append(index)
        return real(self, model, index, modules)

    monkeypatch.setattr(CheckpointExport, "add_layer", interrupt_second)
    with pytest.raises(KeyboardInterrupt):
        quantize_model(QuantizeConfig(model=str(shallow_and_deep[1]), output=tmp_path / "q", device="cpu",
                                      scheme="w8a16", max_shard_size="100KB"))
    assert done == [0] and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("tied", [False, True])
def test_embeddings_norm_and_head_are_copied_from_the_source_as_stored(tmp_path, tied):
    """Never quantized nor folded, so they go to the output as the source stores them (bf16 stays bf16, bit for
    bit), one tensor at a time; a tied head is not written twice. Our engine loads the result."""
    src = write_tiny_llama(tmp_path / "bf16", dtype="bfloat16", tie_word_embeddings=tied, **SHAPE)
    quantize_model(QuantizeConfig(model=str(src), output=tmp_path / "q", scheme="w8a16", device="cpu"))
    source, out = CheckpointTensors(src), CheckpointTensors(tmp_path / "q")
    outer = ["model.embed_tokens.weight", "model.norm.weight", *([] if tied else ["lm_head.weight"])]
    assert sorted(n for n in out.names() if not n.startswith("model.layers.")) == sorted(outer)
    for name in outer:
        assert out.get(name).dtype == torch.bfloat16 and torch.equal(out.get(name), source.get(name)), name
    llm = LLM(str(tmp_path / "q"), dtype="float32", device="cpu", num_kv_blocks=8)
    assert len(llm.generate([[5, 9, 17]], SamplingParams(max_tokens=4, ignore_eos=True))[0].outputs[0].token_ids) == 4
