"""The OpenAI request schema we accept, as pydantic models.

Strict where OpenAI is strict: unknown fields are rejected (400 "unrecognized request argument"), types
and ranges are checked, NaN/inf are refused. Harmless fields clients commonly send (`user`, `metadata`,
`store`, `service_tier`, vLLM's old `guided_decoding_backend`) are accepted and ignored; fields whose
meaning we cannot honour (images, suffix) are refused with a 400 that names them, rather than silently
ignored. Completions honour `echo` (with prompt logprobs, and `max_tokens: 0` to score the prompt only),
`logit_bias` and `best_of`. Structured outputs: OpenAI's `response_format` (`json_schema`, `json_object`,
`text`; on completions too, as vLLM), vLLM's `structured_outputs` {json|regex|choice|grammar|json_object}
and its older `guided_json`/`guided_regex`/`guided_choice`/`guided_grammar`, at most one of them per
request. Chat takes `tools`, `tool_choice` (auto, none, required, a named function), `parallel_tool_calls`,
assistant messages with `tool_calls` and `role: tool` messages. vLLM extensions: `top_k`, `min_p`,
`repetition_penalty`, `min_tokens`, `ignore_eos`, `stop_token_ids`, `include_stop_str_in_output`,
`skip_special_tokens`, `prompt_logprobs`; ours: `priority` (higher value = more important). /tokenize
and /detokenize take vLLM's bodies.
"""

from __future__ import annotations

import json
import types
from functools import cache
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

MAX_N = 8
MAX_STOP = 16
MAX_PROMPTS = 32
MAX_LOGIT_BIAS = 1024  # entries
MAX_LOGPROBS = 20
PRIORITY_RANGE = 1000
MAX_CHOICES = 1024  # guided_choice / structured_outputs.choice entries
MAX_TOOLS = 128
NAME_PATTERN = r"^[a-zA-Z0-9_-]{1,64}$"  # OpenAI's rule for function and response-format names

# OpenAI's logit_bias: token ids (as JSON object keys, so strings) to a bias in [-100, 100]
TokenIdKey = Annotated[str, Field(pattern=r"^[0-9]{1,10}$")]
Bias = Annotated[float, Field(ge=-100.0, le=100.0)]

_STRICT = ConfigDict(extra="forbid", allow_inf_nan=False)


@cache
def _null_means_default(cls: type[BaseModel]) -> frozenset[str]:
    """The keys of `cls`'s optional fields whose type has no null of its own (`n`, `stream`, `echo`...)."""
    out = set()
    for name, f in cls.model_fields.items():
        t = f.annotation
        nullable = t is None or t is type(None) or (get_origin(t) in (Union, types.UnionType)
                                                   and type(None) in get_args(t))
        if not f.is_required() and not nullable:
            out.add(f.alias or name)
    return frozenset(out)


class _Body(BaseModel):
    """A request object. OpenAI marks most optional fields nullable and clients send explicit nulls; as in
    vLLM (whose fields are Optional with a default), a null means the field's default."""

    model_config = _STRICT

    @model_validator(mode="before")
    @classmethod
    def _drop_defaulted_nulls(cls, data: Any) -> Any:
        if isinstance(data, dict):
            keys = _null_means_default(cls)
            return {k: v for k, v in data.items() if v is not None or k not in keys}
        return data


class StreamOptions(_Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM extension: usage on every chunk


class JsonSchemaFormat(_Body):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, populate_by_name=True)

    name: str = Field(..., pattern=NAME_PATTERN)
    description: str | None = None
    schema_: dict[str, Any] = Field(..., alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_iff_json_schema(self):
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is required with type json_schema, and only then")
        return self


Choice = Annotated[list[str], Field(min_length=1, max_length=MAX_CHOICES)]


class StructuredOutputsRequest(_Body):
    """vLLM's `structured_outputs`: exactly one constraint."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = Field(None, min_length=1)
    choice: Choice | None = None
    grammar: str | None = Field(None, min_length=1)
    json_object: bool | None = None

    @model_validator(mode="after")
    def _exactly_one(self):
        given = [k for k, v in (("json", self.json_), ("regex", self.regex), ("choice", self.choice),
                                ("grammar", self.grammar), ("json_object", self.json_object or None))
                 if v is not None]
        if len(given) != 1:
            raise ValueError("give exactly one of json, regex, choice, grammar and json_object"
                             + (f" (got {', '.join(given)})" if given else ""))
        return self


class _Sampling(_Body):
    """Fields shared by both endpoints."""

    model: str | None = None  # None: the served model (vLLM accepts a missing model too)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: dict[TokenIdKey, Bias] | None = Field(None, max_length=MAX_LOGIT_BIAS)
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    # extensions (vLLM)
    top_k: int | None = None
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=10.0)
    min_tokens: int = Field(0, ge=0)
    ignore_eos: bool = False
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)  # per prompt token, top-n (not streamed)
    # extension (ours): priority class, higher = scheduled first
    priority: int | None = Field(None, ge=-PRIORITY_RANGE, le=PRIORITY_RANGE)
    # structured outputs: OpenAI's, vLLM's and vLLM's older fields (at most one per request)
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = Field(None, min_length=1)
    guided_choice: Choice | None = None
    guided_grammar: str | None = Field(None, min_length=1)
    guided_decoding_backend: str | None = None  # accepted and ignored: llguidance is the only backend

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: str | list[str] | None) -> list[str]:
        stops = [] if v is None else [v] if isinstance(v, str) else list(v)
        if len(stops) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop sequences")
        if any(s == "" for s in stops):
            raise ValueError("stop sequences must not be empty")
        return stops

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, v: int | None) -> int | None:
        if v is not None and v < -1:
            raise ValueError("top_k must be -1 or 0 (disabled) or positive")
        return v

    @model_validator(mode="after")
    def _stream_only_fields(self):
        if self.prompt_logprobs is not None and self.stream:
            raise ValueError("prompt_logprobs are not available when stream is true")
        if self.stream_options is not None and self.stream_options.model_fields_set and not self.stream:
            raise ValueError("Stream options can only be defined when `stream=True`.")  # OpenAI's and vLLM's 400
        return self

    def token_bias(self) -> dict[int, float] | None:
        """logit_bias with integer token ids (range-checked against the vocabulary by the server)."""
        return {int(k): v for k, v in self.logit_bias.items()} if self.logit_bias else None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)


Prompt = str | list[str] | list[Annotated[int, Field(ge=0)]] | list[list[Annotated[int, Field(ge=0)]]]


class CompletionRequest(_Sampling):
    prompt: Prompt
    echo: bool = False  # the prompt comes back in `text` (and in logprobs, first token null); before max_tokens
    # OpenAI's legacy default; None: up to max_model_len; 0 (with echo): score the prompt, generate nothing
    max_tokens: int | None = Field(16, ge=0)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1, le=MAX_N)  # generate best_of, return the n most likely

    @field_validator("max_tokens")
    @classmethod
    def _max_tokens(cls, v: int | None, info) -> int | None:
        if v == 0 and not info.data.get("echo"):
            raise ValueError("max_tokens 0 needs echo: true (it scores the prompt without generating)")
        return v

    @model_validator(mode="after")
    def _unsupported(self):
        if self.suffix:
            raise ValueError("suffix is not supported by this server")
        if self.best_of is not None:
            if self.best_of < self.n:
                raise ValueError(f"best_of ({self.best_of}) must be at least n ({self.n})")
            if self.stream and self.best_of > self.n:
                raise ValueError("best_of greater than n cannot be streamed")
        return self

    @property
    def echo_only(self) -> bool:
        """echo with max_tokens 0: the prompt (and its logprobs) only."""
        return self.echo and self.max_tokens == 0

    @property
    def num_generated(self) -> int:
        """Completions generated per prompt (best_of), of which `n` are returned."""
        return self.best_of or self.n

    def prompts(self) -> list[str | list[int]]:
        """One or several prompts, each text or token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            return []
        if all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[list-item]
        return list(p)  # type: ignore[arg-type]


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ToolCallFunction(_Body):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(_Body):
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # assistant: the calls it made
    tool_call_id: str | None = None  # tool: the call this message answers

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, v: Any) -> Any:
        """One line for a part we cannot read, rather than pydantic's error per branch of the union."""
        for i, part in enumerate(v if isinstance(v, list) else []):
            kind = part.get("type") if isinstance(part, dict) else None
            if isinstance(kind, str) and kind != "text":
                what = "image" if "image" in kind else repr(kind)
                raise ValueError(f"{what} content parts are not supported by this server, only text (part {i})")
        return v

    @model_validator(mode="after")
    def _tool_fields(self):
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("only assistant messages have tool_calls")
        if (self.tool_call_id is not None) != (self.role == "tool"):
            raise ValueError("tool messages need tool_call_id, and only they have it")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


def template_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages for the chat template: text content; `developer` is OpenAI's new name for `system`.
    Assistant tool calls and tool results keep transformers' shape (`tool_calls` with `function.arguments`
    parsed when it is JSON, `tool_call_id`); llmopt.serve.tools renders them for templates without tools."""
    out: list[dict[str, Any]] = []
    for m in messages:
        d: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
        if m.tool_calls:
            d["tool_calls"] = [{"id": c.id, "type": "function",
                                "function": {"name": c.function.name, "arguments": _json_or_text(c.function.arguments)}}
                               for c in m.tool_calls]
        if m.tool_call_id is not None:
            d["tool_call_id"] = m.tool_call_id
        if m.name is not None and m.role == "tool":
            d["name"] = m.name
        out.append(d)
    return out


def _json_or_text(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


class FunctionDefinition(_Body):
    name: str = Field(..., pattern=NAME_PATTERN)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; None: no parameters
    strict: bool | None = None  # accepted: arguments are always constrained by the schema when forced


class Tool(_Body):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_tokens: int | None = Field(None, ge=1)  # None: up to max_model_len
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[Tool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None  # None: true, as OpenAI
    add_generation_prompt: bool = True

    @model_validator(mode="after")
    def _check(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        for i, m in enumerate(self.messages):
            if m.content is None and m.role != "assistant":
                raise ValueError(f"messages.{i}.content must not be null for role {m.role!r}")
        return self

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def template_messages(self) -> list[dict[str, Any]]:
        return template_messages(self.messages)

    def tool_problem(self) -> tuple[str, str] | None:
        """(message, param) of what is wrong with tools and tool_choice together, or None."""
        names = [t.function.name for t in self.tools or []]
        dup = next((i for i, n in enumerate(names) if n in names[:i]), None)
        if dup is not None:
            return f"function names must be unique ({names[dup]!r} is given twice)", f"tools.{dup}.function.name"
        tc = self.tool_choice
        if isinstance(tc, NamedToolChoice) and tc.function.name not in names:
            return (f"tool_choice names the function {tc.function.name!r}, which is not in tools",
                    "tool_choice.function.name")
        if tc == "required" and not names:
            return "tool_choice 'required' needs tools", "tool_choice"
        return None

    @property
    def tool_mode(self) -> str | None:
        """None (no tools offered or tool_choice none), "auto", "required" or "named"."""
        if not self.tools or self.tool_choice == "none":
            return None
        if isinstance(self.tool_choice, NamedToolChoice):
            return "named"
        return self.tool_choice or "auto"


class TokenizeRequest(_Body):
    """vLLM's /tokenize: a text `prompt`, or chat `messages` rendered by the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: bool | None = None  # default: True for a prompt, False for messages (the template has them)
    add_generation_prompt: bool = True  # messages only
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt and messages")
        for i, m in enumerate(self.messages or []):
            if m.content is None and m.role != "assistant":
                raise ValueError(f"messages.{i}.content must not be null for role {m.role!r}")
        return self

    def template_messages(self) -> list[dict[str, Any]]:
        return template_messages(self.messages or [])


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0, le=2**63 - 1)]]
