"""ModelRunner: a scheduled step -> ModelInput -> model -> sampler/verifier -> the tokens to append.

Rows are laid out prefill chunks first, then decodes (longest context first, so attention batches
them); only rows that end a sequence's known tokens (and prompt-logprob rows) produce logits.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

import torch

from llmopt.engine.argmax import argmax
from llmopt.engine.model_input import ModelInput
from llmopt.engine.sampler import sample
from llmopt.engine.sequence import Sequence
from llmopt.engine.spec_decode.verifier import verify
from llmopt.layers.attention import AttentionBackend, AttentionMetadata
from llmopt.models.base import CausalLM

PROMPT_LOGPROBS_ROWS = 256  # prompt positions whose full-vocabulary logits are held at once

# one prompt token's {token id: (logprob, rank)}: the token itself and the top-n alternatives
PromptLogprob = dict[int, tuple[float, int]]


@dataclass
class StepResult:
    # per sequence that gained tokens: the tokens to append and their logprobs (None where not asked
    # for). A speculating sequence gains its accepted drafts plus the target's own token.
    new_tokens: list[tuple[Sequence, list[int], list[dict[int, float] | None]]]
    prepare_time: float
    forward_time: float
    sample_time: float
    num_prefill_tokens: int
    num_decode_tokens: int
    # (sequence, index of the first prompt token scored, one entry per scored prompt token)
    prompt_logprobs: list[tuple[Sequence, int, list[PromptLogprob]]] = field(default_factory=list)


class ModelRunner:
    def __init__(self, model: CausalLM, cache, attn_backend: AttentionBackend):
        """`cache`: the KV pool `attn_backend` made, in its layout."""
        self.model, self.cache, self.attn_backend, self.device = model, cache, attn_backend, attn_backend.device

    def _layout(self, chunks: list[tuple[list[int], int, list[int]]], decodes: list[tuple[list[int], int, int]],
                ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Input ids, positions and the backend's attention metadata: `chunks` (block table, start,
        tokens) run as prefill chunks, then `decodes` (block table, position, token)."""
        ids = [t for _, _, toks in chunks for t in toks] + [tok for _, _, tok in decodes]
        pos = [p for _, start, toks in chunks for p in range(start, start + len(toks))] + [c for _, c, _ in decodes]
        meta = self.attn_backend.build_metadata(self.cache, [(t, start, start + len(toks)) for t, start, toks in chunks],
                                                [(t, c) for t, c, _ in decodes])
        dev = self.device
        return torch.tensor(ids, dtype=torch.long, device=dev), torch.tensor(pos, dtype=torch.long, device=dev), meta

    def prepare(self, scheduled: list[tuple[Sequence, int]]) -> ModelInput:
        """One scheduled step's model input: sampled rows, a speculating sequence's rows (its last real
        token and each draft) and the rows that score a prompt for prompt_logprobs."""
        prefills = [(s, n) for s, n in scheduled if n > 1]
        # longest context first, so that decode groups of similar lengths are consecutive rows
        decodes = sorted(((s, n) for s, n in scheduled if n == 1), key=lambda sn: -sn[0].num_computed_tokens)
        logit_rows: list[int] = []
        sample_seqs: list[Sequence] = []
        spec_rows: list[tuple[Sequence, list[int]]] = []
        prompt_rows: list[tuple[Sequence, int, int, int]] = []
        chunks = []
        row = 0  # the first row of the sequence at hand
        for seq, n in prefills + decodes:
            c = seq.num_computed_tokens
            drafts = seq.spec.tokens
            if n > 1:
                chunks.append((seq.block_tables, c, (seq.token_ids + drafts if drafts else seq.token_ids)[c:c + n]))
            last = min(c + n, seq.num_prompt_tokens - 1)  # position p's logits score prompt token p + 1
            if seq.params.prompt_logprobs is not None and last > c:
                prompt_rows.append((seq, row, c, last - c))
            if drafts:
                spec_rows.append((seq, list(range(row, row + n))))
            elif c + n == seq.num_tokens:
                logit_rows.append(row + n - 1)
                sample_seqs.append(seq)
            row += n
        ids, pos, meta = self._layout(chunks, [(s.block_tables, s.num_computed_tokens, s.token_ids[s.num_computed_tokens])
                                               for s, _ in decodes])
        return ModelInput(ids, pos, meta, logit_rows, sample_seqs, spec_rows, prompt_rows, meta.num_prefill_tokens,
                          len(decodes))

    def forward(self, inp: ModelInput, num_layers: int | None = None) -> torch.Tensor:
        """Hidden states [num_tokens, hidden] of one prepared pass; writes its K/V into the cache."""
        if num_layers is None:
            return self.model(inp.input_ids, inp.positions, self.cache, inp.attn_metadata)
        return self.model(inp.input_ids, inp.positions, self.cache, inp.attn_metadata, num_layers=num_layers)

    @torch.inference_mode()
    def greedy_next(self, items: list[tuple[list[int], int, list[int]]], num_layers: int | None = None) -> list[int]:
        """Draft proposals: for each (block tables, start, tokens), run `tokens` at positions start.. over
        the cached context, write their K/V and return the argmax after the last one. `num_layers`: only
        the first layers plus norm and head (layer_skip; the verification pass rewrites the same slots)."""
        inp = self._prepare_draft(items)
        hidden = self.forward(inp, num_layers)
        rows = torch.tensor(inp.logits_indices, device=hidden.device)
        picked = argmax(self.model.compute_logits(hidden[rows])).tolist()
        out = [0] * len(items)
        for i, t in zip(self._draft_order(items), picked, strict=True):
            out[i] = t
        return out

    @staticmethod
    def _draft_order(items: list[tuple[list[int], int, list[int]]]) -> list[int]:
        """Multi-token runs first, then single tokens by decreasing context (prepare's layout)."""
        return ([i for i, it in enumerate(items) if len(it[2]) > 1]
                + sorted((i for i, it in enumerate(items) if len(it[2]) == 1), key=lambda i: -items[i][1]))

    def _prepare_draft(self, items: list[tuple[list[int], int, list[int]]]) -> ModelInput:
        order = self._draft_order(items)
        chunks = [items[i] for i in order if len(items[i][2]) > 1]
        decodes = [(items[i][0], items[i][1], items[i][2][0]) for i in order if len(items[i][2]) == 1]
        ids, pos, meta = self._layout(chunks, decodes)
        rows = list(itertools.accumulate(len(items[i][2]) for i in order))
        return ModelInput(ids, pos, meta, [r - 1 for r in rows], num_prefill_tokens=meta.num_prefill_tokens,
                          num_decode_tokens=len(decodes))

    @torch.inference_mode()
    def execute(self, scheduled: list[tuple[Sequence, int]]) -> StepResult:
        t0 = time.perf_counter()
        inp = self.prepare(scheduled)
        rows, seqs, spec_rows = inp.logits_indices, inp.sample_seqs, inp.spec_rows
        t1 = time.perf_counter()
        hidden = self.forward(inp)
        all_rows = rows + [r for _, rs in spec_rows for r in rs]
        spec_logits: list[torch.Tensor] = []
        if all_rows:
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
