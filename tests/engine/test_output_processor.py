"""OutputProcessor on its own: finish decisions, stop strings and the streamed hold-back."""

from __future__ import annotations

import pytest

from llmopt.engine.detokenizer import init_offsets
from llmopt.engine.output_processor import OutputProcessor
from llmopt.engine.request import Request
from llmopt.engine.sampling_params import SamplingParams
from llmopt.engine.sequence import Sequence, SequenceStatus
from llmopt.models.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def tok(tiny_llama):
    return load_tokenizer(tiny_llama)


def _seq(tok, text: str, **params) -> Sequence:
    seq = Sequence("r", 0, tok.encode(text), SamplingParams(**params), 0.0)
    init_offsets(seq)
    return seq


def _feed(proc: OutputProcessor, seq: Sequence, text: str) -> str | None:
    reason = None
    for t in proc.tokenizer.encode(text):
        reason = proc.append_token(seq, t, None, 0.0)
        if reason is not None:
            return reason
    return reason


def test_max_tokens_and_eos_finish(tok):
    proc = OutputProcessor(tok, [0], max_model_len=1000)
    seq = _seq(tok, "hello", max_tokens=2, ignore_eos=True)
    assert proc.append_token(seq, 5, None, 0.0) is None
    assert proc.append_token(seq, 0, None, 0.0) == "length"  # EOS ignored, max_tokens reached
    seq = _seq(tok, "hello")
    assert proc.append_token(seq, 0, None, 0.0) == "stop" and seq.stop_reason is None


def test_a_stop_string_cuts_the_text_and_the_tail_is_held_back_until_decided(tok):
    proc = OutputProcessor(tok, [], max_model_len=1000)
    seq = _seq(tok, "x", stop=["the end"])
    assert _feed(proc, seq, " and the e") is None
    assert proc.visible_text(seq) == " and "  # "the e" could still become the stop string
    req = Request("r", None, seq.token_ids[:1], seq.params, [seq])
    first = proc.make_output(req).outputs[0]
    assert first.delta_text == " and "
    assert _feed(proc, seq, "nd now") == "stop"
    assert seq.output_text == " and " and seq.stop_reason == "the end"
    seq.status = SequenceStatus.FINISHED
    assert proc.make_output(req).outputs[0].delta_text == ""
