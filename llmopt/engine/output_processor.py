"""OutputProcessor: what appending a token means for a request's text, and when the request stops.

Incremental detokenization; EOS, stop tokens and strings, grammar end and length limits; and the
RequestOutputs, holding back a streamed tail that could still become a stop string. The engine acts.
"""

from __future__ import annotations

from llmopt.engine.detokenizer import detokenize_step
from llmopt.engine.outputs import CompletionOutput, RequestOutput
from llmopt.engine.request import Request
from llmopt.engine.sequence import Sequence


class OutputProcessor:
    def __init__(self, tokenizer, eos_token_ids: list[int], max_model_len: int):
        self.tokenizer, self.eos_token_ids, self.max_model_len = tokenizer, eos_token_ids, max_model_len

    def append_token(self, seq: Sequence, token: int, lp, now: float) -> str | None:
        """Append one generated token (with its logprobs, if asked for) and its text; returns the finish
        reason ("stop", "length") when this token ends the sequence, else None."""
        seq.token_ids.append(token)
        m = seq.metrics
        if m.first_token_time is None:
            m.first_token_time = now
        m.last_token_time = now
        m.token_times.append(now)
        if seq.logprobs is not None and lp is not None:
            seq.logprobs.append(lp)
        p = seq.params
        delta = detokenize_step(self.tokenizer, seq, p.skip_special_tokens)
        n_out = seq.num_output_tokens
        if seq.grammar is not None:
            seq.grammar.accept(token)  # the sampler's mask only offers tokens the grammar accepts
        before = len(seq.output_text)
        seq.output_text += delta
        if n_out >= p.min_tokens:
            if token in self.eos_token_ids and not p.ignore_eos:
                return "stop"
            if token in p.stop_token_ids:
                seq.stop_reason = token
                return "stop"
            if p.stop and self._check_stop_strings(seq, before):
                return "stop"
        if seq.grammar is not None and seq.grammar.is_terminated:  # the constrained output is complete
            reason = "stop"
        elif (p.max_tokens is not None and n_out >= p.max_tokens) or seq.num_tokens >= self.max_model_len:
            reason = "length"
        else:
            return None
        seq.output_text += detokenize_step(self.tokenizer, seq, p.skip_special_tokens, final=True)
        return reason

    @staticmethod
    def _check_stop_strings(seq: Sequence, before: int) -> bool:
        """Cut the text at the first stop string that the newest text completes."""
        text = seq.output_text
        for stop in seq.params.stop:
            idx = text.find(stop, max(0, before - len(stop) + 1))
            if idx != -1:
                end = idx + len(stop) if seq.params.include_stop_str_in_output else idx
                seq.output_text = text[:end]
                seq.stop_reason = stop
                return True
        return False

    @staticmethod
    def visible_text(seq: Sequence) -> str:
        """Text safe to stream: hold back a tail that could still become a stop string."""
        text = seq.output_text
        if seq.is_finished or not seq.params.stop or seq.params.include_stop_str_in_output:
            return text
        # the longest tail that is a proper prefix of some stop string
        hold = max((k for stop in seq.params.stop for k in range(1, min(len(stop) - 1, len(text)) + 1)
                    if text.endswith(stop[:k])), default=0)
        return text[:len(text) - hold] if hold else text

    def make_output(self, req: Request) -> RequestOutput:
        """The request's state now, with the text each completion gained since its previous output."""
        comps = []
        for seq in req.seqs:
            visible = self.visible_text(seq)
            delta = visible[seq.sent_text_len:]
            seq.sent_text_len = max(seq.sent_text_len, len(visible))
            comps.append(CompletionOutput(seq.index, visible, list(seq.output_token_ids), seq.finish_reason,
                                          seq.stop_reason, seq.logprobs, delta))
        m = req.seqs[0].metrics
        return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, comps, req.finished, m,
                             m.num_cached_tokens, req.prompt_logprobs)
