"""Tool calling for chat: rendering tools into the prompt, constraining forced calls, parsing calls out.

Format: Hermes / Qwen2.5 / Qwen3 style, one JSON object per call inside tags,

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

(`parameters` is read as a synonym of `arguments`). Prompts: a chat template that takes `tools` (its
source mentions them, as Qwen's and Hermes' do) gets them, with assistant `tool_calls` and `role: tool`
messages in transformers' shape. A template that does not (SmolLM2's) gets the generic rendering: a
system block listing the tools and the format above (Qwen2.5's wording), assistant calls written back
as `<tool_call>` blocks and tool results as a user turn of `<tool_response>` blocks.

`tool_choice: required` and a named function are constrained: a Lark grammar (llguidance) that admits
only `<tool_call>` blocks whose JSON is one of the offered functions (or the named one) with arguments
valid under its parameter schema, so the arguments always parse. `auto` is not constrained: the model
may answer in text or call tools, and whatever `<tool_call>` blocks it writes are parsed.

`ToolCallParser` is the one parser for both shapes of response: fed the text as it streams, it yields
content (text outside the blocks, with the surrounding whitespace trimmed), the start of each call
(its name, once known) and the call's argument text as it grows, so a streamed response and a whole
one agree by construction. Arguments are the model's own text (the JSON value's span), as OpenAI
returns them; in `auto` mode they are not checked against the schema.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from llmopt.serve.protocol import Tool

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_SCALAR = re.compile(r"[^,}\]\s]*")
_WS = re.compile(r"\s*")
_CALL_JSON = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

GENERIC_SYSTEM = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": <args-json-object>}}\n"
    "</tool_call>"
)


def tool_dicts(tools: list[Tool]) -> list[dict[str, Any]]:
    """OpenAI's tool objects as plain dicts (what chat templates and the generic rendering list)."""
    return [t.model_dump(exclude_none=True) for t in tools]


def template_supports_tools(tokenizer) -> bool:
    """Whether the tokenizer's chat template renders `tools` itself."""
    tpl = getattr(tokenizer, "chat_template", None)
    if isinstance(tpl, dict):
        return "tool_use" in tpl or any("tools" in t for t in tpl.values())
    return isinstance(tpl, str) and "tools" in tpl


def _call_text(call: dict[str, Any]) -> str:
    fn = call["function"]
    args = fn["arguments"]
    return f"{OPEN}\n{json.dumps({'name': fn['name'], 'arguments': args}, ensure_ascii=False)}\n{CLOSE}"


def generic_messages(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[dict[str, str]]:
    """A conversation with tools for a template that knows nothing about them: the tools in a system block,
    assistant calls as `<tool_call>` text, tool results (consecutive ones merged) as a user turn."""
    out: list[dict[str, str]] = []
    for m in messages:
        role, content = m["role"], m.get("content") or ""
        if role == "tool":
            block = f"<tool_response>\n{content}\n</tool_response>"
            if out and out[-1].get("_tool"):
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "_tool": "1"})
            continue
        if role == "assistant" and m.get("tool_calls"):
            content = "\n".join([content] * bool(content) + [_call_text(c) for c in m["tool_calls"]])
        out.append({"role": role, "content": content})
    for m in out:
        m.pop("_tool", None)
    if tools:
        block = GENERIC_SYSTEM.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))
        if out and out[0]["role"] == "system":
            out[0]["content"] = f"{out[0]['content']}\n\n{block}" if out[0]["content"] else block
        else:
            out.insert(0, {"role": "system", "content": block})
    return out


def _parameters(tool: Tool) -> dict[str, Any]:
    params = tool.function.parameters
    if not params:
        return {"type": "object", "properties": {}, "additionalProperties": False}
    return params


def tool_grammar(tools: list[Tool], name: str | None, parallel: bool) -> str:
    """Lark (llguidance) for a forced call: one `<tool_call>` block (several when `parallel`) whose JSON
    names one of `tools` (or `name`) and whose arguments satisfy that function's parameter schema."""
    chosen = [t for t in tools if name is None or t.function.name == name]
    variants = [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
                 "properties": {"name": {"const": t.function.name}, "arguments": _parameters(t)}} for t in chosen]
    schema: dict[str, Any] = variants[0] if len(variants) == 1 else {"anyOf": variants}
    schema = {**schema, "x-guidance": _CALL_JSON}
    repeat = ' ("\\n" call)*' if parallel else ""
    return (f"start: call{repeat}\n"
            f'call: "{OPEN}\\n" body "\\n{CLOSE}"\n'
            f"body: %json {json.dumps(schema, ensure_ascii=False)}\n")


# ---- parsing ------------------------------------------------------------------------------------------
def _string_end(s: str, i: int) -> int | None:
    """s[i] is '"': the index after the closing quote, None if the string is not closed yet."""
    j = i + 1
    while j < len(s):
        c = s[j]
        if c == "\\":
            j += 2
        elif c == '"':
            return j + 1
        else:
            j += 1
    return None


def _value_end(s: str, i: int) -> int | None:
    """The end of the JSON value starting at s[i], None while it is incomplete."""
    c = s[i]
    if c == '"':
        return _string_end(s, i)
    if c in "{[":
        depth, j = 0, i
        while j < len(s):
            c = s[j]
            if c == '"':
                e = _string_end(s, j)
                if e is None:
                    return None
                j = e
                continue
            if c in "{[":
                depth += 1
            elif c in "}]":
                depth -= 1
                if depth == 0:
                    return j + 1
            j += 1
        return None
    end = _SCALAR.match(s, i).end()
    return end if end < len(s) else None


@dataclass
class _Scan:
    name: str | None = None
    args: tuple[int, int | None] | None = None  # span of the arguments value (end None: still growing)
    valid: bool = True  # False: not a JSON object of a call (then it is content)


def scan_call(body: str) -> _Scan:
    """What the (possibly partial) JSON object of one call says so far: its name and arguments span."""
    out = _Scan()
    i = _WS.match(body).end()
    if i == len(body):
        return out
    if body[i] != "{":
        out.valid = False
        return out
    i += 1
    while True:
        i = _WS.match(body, i).end()
        if i >= len(body) or body[i] == "}":
            return out
        if body[i] == ",":
            i += 1
            continue
        if body[i] != '"':
            out.valid = False
            return out
        key_end = _string_end(body, i)
        if key_end is None:
            return out
        key = json.loads(body[i:key_end])
        i = _WS.match(body, key_end).end()
        if i >= len(body):
            return out
        if body[i] != ":":
            out.valid = False
            return out
        i = _WS.match(body, i + 1).end()
        if i >= len(body):
            return out
        end = _value_end(body, i)
        if key == "name" and end is not None:
            name = json.loads(body[i:end])
            if not isinstance(name, str):
                out.valid = False
                return out
            out.name = name
        elif key in ("arguments", "parameters") and out.args is None:
            out.args = (i, end)
        if end is None:
            return out
        i = end


@dataclass
class ToolCallDelta:
    index: int
    name: str | None = None  # set on the call's first delta (with arguments "")
    arguments: str = ""


@dataclass
class _Call:
    index: int | None = None  # set when its name is known and its first delta sent
    args_sent: int = 0
    broken: bool = False  # not the JSON object of a call: its text goes out as content


@dataclass
class ToolCallParser:
    """Incremental: `feed(text)` per streamed delta, `feed("", final=True)` at the end. Each call returns
    a list of str (content) and ToolCallDelta items, in order."""

    buf: str = ""
    num_calls: int = 0
    _call: _Call | None = None  # the block being read (between the tags)
    _pending_ws: str = ""
    _content_started: bool = False

    def _content(self, text: str, out: list) -> None:
        text = self._pending_ws + text
        self._pending_ws = ""
        if not self._content_started:
            text = text.lstrip()
        kept = text.rstrip()
        self._pending_ws = text[len(kept):]
        if kept:
            out.append(kept)
            self._content_started = True

    def _update(self, call: _Call, body: str, done: bool, out: list) -> None:
        scan = scan_call(body)
        if call.index is None:
            if not scan.valid:
                call.broken = True
                return
            if scan.name is None:
                return
            call.index = self.num_calls
            self.num_calls += 1
            out.append(ToolCallDelta(call.index, name=scan.name))
        if scan.args is not None:
            start, end = scan.args
            args = body[start:len(body) if end is None else end]
            if len(args) > call.args_sent:
                out.append(ToolCallDelta(call.index, arguments=args[call.args_sent:]))
                call.args_sent = len(args)
        elif done and call.args_sent == 0:  # a call without arguments
            out.append(ToolCallDelta(call.index, arguments="{}"))
            call.args_sent = 2

    def feed(self, text: str, final: bool = False) -> list[str | ToolCallDelta]:
        out: list[str | ToolCallDelta] = []
        self.buf += text
        while True:
            call = self._call
            if call is None:
                k = self.buf.find(OPEN)
                if k >= 0:
                    self._content(self.buf[:k], out)
                    self.buf = self.buf[k + len(OPEN):]
                    self._call = _Call()
                    continue
                hold = next((n for n in range(min(len(OPEN) - 1, len(self.buf)), 0, -1)
                             if self.buf.endswith(OPEN[:n])), 0)
                self._content(self.buf[:len(self.buf) - hold], out)
                # at the end, a held-back tag start was a call cut off by max_tokens: never content
                self.buf = "" if final else self.buf[len(self.buf) - hold:]
                return out
            k = self.buf.find(CLOSE)
            done = k >= 0 or final
            body = self.buf if k < 0 else self.buf[:k]
            if not call.broken:
                self._update(call, body, done, out)
            if not done:
                return out
            if call.index is None and (call.broken or k >= 0):  # never became a call: its text is content
                self._content(OPEN + body + (CLOSE if k >= 0 else ""), out)
            # (a block cut off before its name, as `<tool_call>\n{"na`, is dropped like a cut-off tag)
            self.buf = self.buf[k + len(CLOSE):] if k >= 0 else ""
            self._call = None


@dataclass
class ParsedMessage:
    content: str | None
    tool_calls: list[tuple[str, str]]  # (name, arguments)


def parse_tool_calls(text: str) -> ParsedMessage:
    """A whole response: its content (None when empty) and calls, exactly as the stream would give them."""
    parser = ToolCallParser()
    content: list[str] = []
    calls: list[list[str]] = []
    for item in parser.feed(text, final=True):
        if isinstance(item, str):
            content.append(item)
        elif item.name is not None:
            calls.append([item.name, ""])
        else:
            calls[item.index][1] += item.arguments
    return ParsedMessage("".join(content) or None, [(n, a) for n, a in calls])
