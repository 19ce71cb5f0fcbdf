"""Prompts: text, token ids and chat messages turned into token ids, on the asyncio side.

The server keeps a tokenizer of its own (loaded from the engine's weights directory) so that the
handlers never touch the engine's, which belongs to the engine thread. Encoding matches the engine's
and `LLM`'s exactly: completions use `tokenizer.encode(prompt)` (special tokens added as the tokenizer
does), chat renders the template and encodes without adding special tokens (the template has them).
Tools go through the template when it renders them, else through llmopt.serve.tools' generic rendering.
"""

from __future__ import annotations

import json
from typing import Any

from llmopt.serve.errors import ApiError
from llmopt.serve.tools import generic_messages, template_supports_tools


def _check_unicode(text: str, param: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ApiError(400, f"{param} contains invalid unicode (a lone surrogate)", param=param,
                       code="invalid_unicode") from None


class PromptBuilder:
    def __init__(self, tokenizer, vocab_size: int, max_model_len: int):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self._piece_cache: dict[int, str] = {}
        self.native_tools = template_supports_tools(tokenizer)  # the chat template renders `tools` itself

    def encode_prompt(self, prompt: str | list[int], param: str = "prompt") -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise ApiError(400, f"{param} must not be empty", param=param)
            _check_unicode(prompt, param)
            ids = list(self.tokenizer.encode(prompt))
        else:
            ids = list(prompt)
            if any(t >= self.vocab_size for t in ids):
                raise ApiError(400, f"{param}: token ids must be in [0, {self.vocab_size})", param=param)
        if not ids:
            raise ApiError(400, f"{param} must not be empty", param=param)
        return ids

    def tokenize(self, text: str, add_special_tokens: bool = True, param: str = "prompt") -> list[int]:
        """/tokenize: any text, the empty one included."""
        _check_unicode(text, param)
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: list[int], param: str = "tokens") -> str:
        """/detokenize and echo of token prompts: the text of token ids, special tokens included."""
        if any(t >= self.vocab_size for t in ids):
            raise ApiError(400, f"{param}: token ids must be in [0, {self.vocab_size})", param=param)
        return self.tokenizer.decode(ids)

    def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    add_special_tokens: bool = False, tools: list[dict[str, Any]] | None = None) -> list[int]:
        """`tools`: OpenAI tool objects to offer the model (None: none)."""
        for i, m in enumerate(messages):
            _check_unicode(m["content"], f"messages.{i}.content")
            if m.get("tool_calls"):
                _check_unicode(json.dumps(m["tool_calls"], ensure_ascii=False), f"messages.{i}.tool_calls")
        if tools:
            _check_unicode(json.dumps(tools, ensure_ascii=False), "tools")
        extra: dict[str, Any] = {}
        if not self.native_tools and (tools or any(m["role"] == "tool" or m.get("tool_calls") for m in messages)):
            messages = generic_messages(messages, tools)
        elif tools:
            extra["tools"] = tools
        try:
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                      tokenize=False, **extra)
        except Exception as e:  # jinja errors for conversations the template refuses
            raise ApiError(400, f"cannot apply the chat template: {str(e).splitlines()[0] if str(e) else e}",
                           param="messages") from None
        _check_unicode(text, "messages")  # names and ids: whatever else went into the prompt
        ids = list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))
        if not ids:
            raise ApiError(400, "the conversation renders to an empty prompt", param="messages")
        return ids

    def check_length(self, ids: list[int], param: str) -> None:
        """400 for prompts that leave no room for one output token."""
        if len(ids) >= self.max_model_len:
            raise ApiError(400, f"{param} has {len(ids)} tokens, but this server's maximum context length is "
                           f"{self.max_model_len} tokens (prompt plus at least one output token)",
                           param=param, code="context_length_exceeded")

    def piece(self, token_id: int) -> str:
        """The text of one token, for logprobs."""
        s = self._piece_cache.get(token_id)
        if s is None:
            s = self.tokenizer.decode([token_id])
            if len(self._piece_cache) < 200_000:
                self._piece_cache[token_id] = s
        return s
