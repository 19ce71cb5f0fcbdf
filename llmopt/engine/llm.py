"""LLM: the offline facade over LLMEngine, mirroring vLLM's `LLM.generate` / `LLM.chat`."""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import Any

from llmopt.engine.config import EngineConfig
from llmopt.engine.llm_engine import LLMEngine, RequestError
from llmopt.engine.outputs import RequestOutput
from llmopt.engine.sampling_params import SamplingParams


class LLM:
    """`LLM("smollm2-135m", dtype="float32", max_num_seqs=64, enable_prefix_caching=True)`."""

    def __init__(self, model: str | None = None, **engine_args: Any):
        self.engine = LLMEngine(EngineConfig(model=model, **engine_args))

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts, sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 use_tqdm: bool = False, priority: list[int] | None = None) -> list[RequestOutput]:
        """Run every prompt to completion with continuous batching; outputs keep the input order."""
        items = [prompts] if isinstance(prompts, (str, dict)) else list(prompts)
        if items and isinstance(items[0], int):
            items = [items]  # one list of token ids
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(items)
        else:
            params = list(sampling_params)
            if len(params) != len(items):
                raise ValueError("sampling_params must be one object or one per prompt")
        ids = []
        for i, (item, p) in enumerate(zip(items, params, strict=True)):
            if not isinstance(item, dict):
                item = {"prompt": item} if isinstance(item, str) else {"prompt_token_ids": list(item)}
            ids.append(self.engine.add_request(None, prompt=item.get("prompt"), params=p,
                                               prompt_token_ids=item.get("prompt_token_ids"),
                                               priority=priority[i] if priority else 0))
        return self._run(ids, use_tqdm)

    def chat(self, messages, sampling_params: SamplingParams | None = None,
             use_tqdm: bool = False) -> list[RequestOutput]:
        """One conversation (a list of {role, content}) or a list of conversations."""
        if not messages:
            raise RequestError("messages must not be empty")
        convs = [messages] if isinstance(messages[0], dict) else list(messages)
        prompts = [{"prompt": text, "prompt_token_ids": self.engine.tokenizer.encode(text, add_special_tokens=False)}
                   for text in (self.engine.apply_chat_template(c) for c in convs)]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

        results: dict[str, RequestOutput] = {}
        wanted = set(request_ids)
        with Progress("[progress.description]{task.description}", BarColumn(), MofNCompleteColumn(),
                      TimeElapsedColumn(), transient=True, disable=not use_tqdm) as progress:
            task = progress.add_task("generating", total=len(request_ids))
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished and out.request_id in wanted:
                        results[out.request_id] = out
                        progress.advance(task)
        return [results[r] for r in request_ids]


def stream_text(llm: LLM, prompt: str, params: SamplingParams, chat: bool = False):
    """Yield text deltas of one request as the engine produces them, then the final RequestOutput."""
    eng = llm.engine
    text = eng.apply_chat_template([{"role": "user", "content": prompt}]) if chat else prompt
    ids = eng.tokenizer.encode(text, add_special_tokens=False) if chat else None  # the template has the BOS
    rid = eng.add_request(prompt=text, prompt_token_ids=ids, params=params)
    while True:
        for out in (o for o in eng.step() if o.request_id == rid):
            if out.outputs[0].delta_text:
                yield out.outputs[0].delta_text
            if out.finished:
                yield out
                return
