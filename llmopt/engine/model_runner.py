"""ModelRunner: a scheduled step -> ModelInput -> model -> sampler/verifier -> the tokens to append.

Rows are laid out prefill chunks first, then decodes (longest context first, so attention batches
them); only rows that end a sequence's known tokens (and prompt-logprob rows) produce logits.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Collection
from dataclasses import dataclass, field

import torch

from llmopt.engine.argmax import argmax
from llmopt.engine.model_input import ModelInput
from llmopt.engine.sampler import sample
from llmopt.engine.sequence import Sequence
from llmopt.engine.spec_decode.verifier import verify
from llmopt.layers.attention import AttentionBackend, AttentionMetadata
from llmopt.models.base import CausalLM
from llmopt.step import DecodeStep

PROMPT_LOGPROBS_ROWS = 256  # prompt positions whose full-vocabulary logits are held at once

# one prompt token's {token id: (logprob, rank)}: the token itself and the top-n alternatives
PromptLogprob = dict[int, tuple[float, int]]


@dataclass
class StepResult:
    # per sequence that gained tokens: the tokens to append (a speculating one: its accepted drafts and
    # the target's own token) and their logprobs (None where not asked for)
    new_tokens: list[tuple[Sequence, list[int], list[dict[int, float] | None]]]
    prepare_time: float
    forward_time: float
    sample_time: float
    num_prefill_tokens: int
    num_decode_tokens: int
    # (sequence, index of the first prompt token scored, one entry per scored prompt token)
    prompt_logprobs: list[tuple[Sequence, int, list[PromptLogprob]]] = field(default_factory=list)


class ModelRunner:
    def __init__(self, model: CausalLM, cache, attn_backend: AttentionBackend, native_step: bool = True):
        """`cache`: the KV pool `attn_backend` made, in its layout. `native_step`: decode steps run as one
        native call where `DecodeStep` takes them (llmopt.step), else layer by layer."""
        self.model, self.cache, self.attn_backend, self.device = model, cache, attn_backend, attn_backend.device
        self.decode_step = DecodeStep.build(model, cache, attn_backend) if native_step else None

    def _layout(self, items: list[tuple[list[list[int]], int, list[int]]], as_decodes: Collection[int] = (),
                ) -> tuple[list[int], torch.Tensor, torch.Tensor, AttentionMetadata]:
        """The row order, input ids, positions and the backend's attention metadata of a pass over `items`
        (block tables, first position, tokens). Multi-token runs go first as prefill chunks, in input order,
        then single tokens as decodes by decreasing context, so decode groups of similar lengths are
        consecutive rows. The items in `as_decodes` (a speculating sequence's last token and its drafts) are
        decodes too, one row per token over the context up to it, their rows consecutive: each row attends as
        a decode of that token alone would, so the native decode step takes the step. `order[j]`: the item of
        the j-th run of rows."""
        as_decodes = set(as_decodes)
        decode = [i for i, it in enumerate(items) if len(it[2]) == 1 or i in as_decodes]
        order = [i for i, it in enumerate(items) if len(it[2]) > 1 and i not in as_decodes]
        order += sorted(decode, key=lambda i: -items[i][1])
        runs = [items[i] for i in order]
        ids = [t for _, _, toks in runs for t in toks]
        pos = [p for _, start, toks in runs for p in range(start, start + len(toks))]
        n_prefill = len(items) - len(decode)
        meta = self.attn_backend.build_metadata(
            self.cache, [(t, start, start + len(toks)) for t, start, toks in runs[:n_prefill]],
            [(t, p) for t, start, toks in runs[n_prefill:] for p in range(start, start + len(toks))])
        ids_t, pos_t = (torch.tensor(x, dtype=torch.long, device=self.device) for x in (ids, pos))
        return order, ids_t, pos_t, meta

    def prepare(self, scheduled: list[tuple[Sequence, int]]) -> ModelInput:
        """One scheduled step's model input: sampled rows, a speculating sequence's rows (its last real
        token and each draft) and the rows that score a prompt for prompt_logprobs."""
        items = []
        for seq, n in scheduled:  # a speculating sequence computes its last real token, then its drafts
            c = seq.num_computed_tokens
            toks = seq.token_ids[c:c + n]
            items.append((seq.block_tables, c, toks + seq.spec.tokens[:n - len(toks)]))
        verifying = {i for i, (seq, _) in enumerate(scheduled) if seq.spec.tokens and seq.num_computed_tokens > 0}
        order, ids, pos, meta = self._layout(items, verifying)
        inp = ModelInput(ids, pos, meta, [], order=order, num_prefill_tokens=meta.num_prefill_tokens,
                         num_decode_tokens=len(ids) - meta.num_prefill_tokens)
        row = 0  # the first row of the sequence at hand
        for seq, n in (scheduled[i] for i in order):
            c = seq.num_computed_tokens
            last = min(c + n, seq.num_prompt_tokens - 1)  # position p's logits score prompt token p + 1
            if seq.params.prompt_logprobs is not None and last > c:
                inp.prompt_rows.append((seq, row, c, last - c))
            if seq.spec.tokens:
                inp.spec_rows.append((seq, list(range(row, row + n))))
            elif c + n == seq.num_tokens:
                inp.logits_indices.append(row + n - 1)
                inp.sample_seqs.append(seq)
            row += n
        return inp

    def forward(self, inp: ModelInput, num_layers: int | None = None) -> torch.Tensor:
        """Hidden states [num_tokens, hidden] of one prepared pass; writes its K/V into the cache."""
        if self.decode_step is not None and self.decode_step.takes(inp.attn_metadata):
            return self.decode_step(inp.input_ids, inp.positions, inp.attn_metadata, num_layers)
        return self.model(inp.input_ids, inp.positions, self.cache, inp.attn_metadata, num_layers=num_layers)

    @torch.inference_mode()
    def greedy_next(self, items: list[tuple[list[list[int]], int, list[int]]], num_layers: int | None = None
                    ) -> list[int]:
        """Draft proposals: for each (block tables, start, tokens), run `tokens` at positions start.. over
        the cached context, write their K/V and return the argmax after the last one. `num_layers`: only
        the first layers plus norm and head (layer_skip; the verification pass rewrites the same slots)."""
        order, ids, pos, meta = self._layout(items)
        last = [end - 1 for end in itertools.accumulate(len(items[i][2]) for i in order)]  # each run's last row
        hidden = self.forward(ModelInput(ids, pos, meta, last), num_layers)
        picked = argmax(self.model.compute_logits(hidden[torch.tensor(last, device=hidden.device)])).tolist()
        return [t for _, t in sorted(zip(order, picked, strict=True))]  # back in input order

    @torch.inference_mode()
    def execute(self, scheduled: list[tuple[Sequence, int]]) -> StepResult:
        t0 = time.perf_counter()
        inp = self.prepare(scheduled)
        rows, seqs, spec_rows = inp.logits_indices, inp.sample_seqs, inp.spec_rows
        t1 = time.perf_counter()
        hidden = self.forward(inp)
        spec_logits: list[torch.Tensor] = []
        if not spec_rows and len(rows) == hidden.shape[0]:  # every row sampled (rows ascend): no gather
            logits = self.model.compute_logits(hidden)
        elif all_rows := rows + [r for _, rs in spec_rows for r in rs]:
            all_logits = self.model.compute_logits(hidden[torch.tensor(all_rows, device=hidden.device)])
            logits, *spec_logits = all_logits.split([len(rows)] + [len(rs) for _, rs in spec_rows])
        prompt_lps = [(seq, pos + 1, self._prompt_logprobs(hidden[row:row + m], seq.token_ids[pos + 1:pos + 1 + m],
                                                           seq.params.prompt_logprobs or 0))
                      for seq, row, pos, m in inp.prompt_rows]
        t2 = time.perf_counter()
        new_tokens: list[tuple[Sequence, list[int], list[dict[int, float] | None]]] = []
        if rows:
            tokens, lps = sample(logits, seqs)
            new_tokens = [(s, [t], [lp]) for s, t, lp in zip(seqs, tokens, lps, strict=True)]
        # verified after sampling: both may draw from the global generator, in this order
        for (seq, _), lg in zip(spec_rows, spec_logits, strict=True):
            out = verify(lg, seq.spec.tokens, seq.params, seq.generator, seq.grammar)
            new_tokens.append((seq, out, [None] * len(out)))
        t3 = time.perf_counter()
        return StepResult(new_tokens, t1 - t0, t2 - t1, t3 - t2, inp.num_prefill_tokens, inp.num_decode_tokens,
                          prompt_lps)

    def _prompt_logprobs(self, hidden: torch.Tensor, targets: list[int], top_n: int) -> list[PromptLogprob]:
        """Each target token's logprob and rank (1 = argmax) plus the top_n alternatives, in bounded chunks."""
        out: list[PromptLogprob] = []
        for a in range(0, len(targets), PROMPT_LOGPROBS_ROWS):
            lp = torch.log_softmax(self.model.compute_logits(hidden[a:a + PROMPT_LOGPROBS_ROWS]), dim=-1)
            tgt = torch.tensor(targets[a:a + PROMPT_LOGPROBS_ROWS], dtype=torch.long, device=lp.device)
            tok_lp = lp.gather(1, tgt.unsqueeze(1))
            ranks = ((lp > tok_lp).sum(dim=1) + 1).tolist()
            top_vals, top_ids = (x.tolist() for x in lp.topk(top_n, dim=-1))
            for i, (t, v) in enumerate(zip(tgt.tolist(), tok_lp.squeeze(1).tolist(), strict=True)):
                top = zip(top_ids[i], top_vals[i], strict=True)
                d: PromptLogprob = {tid: (tv, j + 1) for j, (tid, tv) in enumerate(top)}
                d[t] = (v, ranks[i])
                out.append(d)
        return out
