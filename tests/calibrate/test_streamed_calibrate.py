"""`calibrate` streams the model as `quantize` does: one decoder layer in memory at a time."""

from __future__ import annotations

from llmopt.calibrate.run import CalibrateConfig, run_calibration
from llmopt.testing.live_bytes import LiveTensorBytes
from llmopt.testing.tiny_model import write_tiny_llama

# wide enough that a decoder layer (~1 MB in fp32) outweighs the embedding and the windows' activations
SHAPE = {"hidden_size": 128, "intermediate_size": 512, "num_heads": 4, "num_kv_heads": 2}
TEXT = ("The quick brown fox jumps over the lazy dog. A KV cache stores keys and values for every token. "
        "Quantization trades a little quality for memory bandwidth and speed. ") * 20


def _peak(model, data, out) -> int:
    with LiveTensorBytes() as live:
        run_calibration(CalibrateConfig(model=str(model), data=[str(data)], num_samples=4, seq_len=32,
                                        output=out, device="cpu", forward_dtype="float32"))
    return live.peak


def test_peak_tensor_memory_does_not_grow_with_depth(tmp_path):
    """2 and 8 layers of the same width: the same peak within 10%; holding the model would be 3-4x."""
    data = tmp_path / "calib.txt"
    data.write_text(TEXT)
    shallow = write_tiny_llama(tmp_path / "shallow", num_layers=2, **SHAPE)
    deep = write_tiny_llama(tmp_path / "deep", num_layers=8, **SHAPE)
    _peak(shallow, data, tmp_path / "warm")  # kernels and caches
    a, b = _peak(shallow, data, tmp_path / "a"), _peak(deep, data, tmp_path / "b")
    assert b <= 1.1 * a, f"8 layers peaked at {b} live bytes, 2 layers at {a}"
