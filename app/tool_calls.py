"""Qwen3 XML tool calls in generated text, parsed into OpenAI `tool_calls` (streaming-safe).

The Qwen3.5 / Qwen3.6 chat template asks the model to call a function like this (vLLM's
`qwen3_coder` tool parser reads the same format):

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

A parameter's value is the text between `<parameter=NAME>\\n` and `\\n</parameter>`; it is typed by
the tool's JSON schema (`integer`, `number`, `boolean`, `null`, `object`, `array`; `string` and
parameters without a schema stay strings; a value that does not fit its type stays a string).

`ToolCallStream` takes text in pieces of any size and gives the same result for every split: text
that might start `<tool_call>` is held back, and a call is reported once its `</tool_call>` arrives.
A block that is not a well-formed call of a known function (e.g. from a random-weights model), or
that never ends, comes back as plain content, unchanged. Whitespace right before and after a parsed
call is dropped (the template puts newlines there); all other text is content.
"""

from __future__ import annotations

import ast
import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

CALL_START = "<tool_call>"
CALL_END = "</tool_call>"
_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>(.*)</function>\s*", re.DOTALL)
_PARAMETER = re.compile(r"\s*<parameter=([^>\n]+)>(.*?)</parameter>", re.DOTALL)
_INTEGER = re.compile(r"[+-]?\d+")


@dataclass(frozen=True)
class ToolCall:
    """One parsed call: the function's name and its arguments (a dict typed by the tool's schema)."""

    name: str
    arguments: dict[str, Any]
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def to_openai(self, index: int | None = None) -> dict[str, Any]:
        """The OpenAI `tool_calls` entry (with "index" for a streamed delta)."""
        entry: dict[str, Any] = {} if index is None else {"index": index}
        arguments = json.dumps(self.arguments, ensure_ascii=False)
        entry.update(id=self.id, type="function", function={"name": self.name, "arguments": arguments})
        return entry


Event = tuple[str, Any]  # ("content", str) or ("tool_call", ToolCall)


class ToolCallStream:
    """Splits generated text into content and tool calls, piece by piece (see the module docstring).

    tools: the request's OpenAI tool definitions ({"type": "function", "function": {"name",
    "parameters"}}); a call of any other function name is not a call.
    """

    def __init__(self, tools: list[dict[str, Any]]):
        self.schemas = {t["function"]["name"]: t["function"].get("parameters") or {} for t in tools}
        self.buffer = ""  # text not yet decided
        self.in_call = False  # the buffer is inside <tool_call> ... (not yet closed)
        self.space = ""  # whitespace held back: dropped if a call follows
        self.after_call = False  # drop whitespace that directly follows a parsed call
        self.calls = 0

    def feed(self, text: str) -> list[Event]:
        """Events for `text`, the next piece of the generated answer."""
        self.buffer += text
        events: list[Event] = []
        while True:
            if self.in_call:
                end = self.buffer.find(CALL_END)
                if end < 0:
                    return events
                block, self.buffer = self.buffer[:end], self.buffer[end + len(CALL_END) :]
                self.in_call = False
                events += self._close(block)
                continue
            start = self.buffer.find(CALL_START)
            if start < 0:
                keep = partial_tag_suffix(self.buffer, CALL_START)
                events += self._text(self.buffer[: len(self.buffer) - keep], final=False)
                self.buffer = self.buffer[len(self.buffer) - keep :]
                return events
            events += self._text(self.buffer[:start], final=False)
            self.buffer, self.in_call = self.buffer[start + len(CALL_START) :], True

    def finish(self) -> list[Event]:
        """Events for what is still held back, at the end of the answer."""
        rest, self.buffer = self.buffer, ""
        if self.in_call:  # never closed: not a call
            self.in_call = False
            return self._content(self.space + CALL_START + rest)
        return self._text(rest, final=True)

    def _text(self, text: str, *, final: bool) -> list[Event]:
        """Plain text between calls: hold trailing whitespace (a call may follow) unless final."""
        if self.after_call:
            text = text.lstrip()
            if not text:
                return []
            self.after_call = False
        text = self.space + text
        body = text if final else text.rstrip()
        self.space = text[len(body) :]
        return [("content", body)] if body else []

    def _close(self, block: str) -> list[Event]:
        call = parse_call(block, self.schemas)
        if call is None:
            return self._content(self.space + CALL_START + block + CALL_END)
        self.space, self.after_call = "", True
        self.calls += 1
        return [("tool_call", call)]

    def _content(self, text: str) -> list[Event]:
        self.space, self.after_call = "", False
        return [("content", text)] if text else []


def parse_tool_calls(text: str, tools: list[dict[str, Any]]) -> tuple[str, list[ToolCall]]:
    """(content, calls) of a whole generated answer: the same as streaming it through `ToolCallStream`."""
    stream = ToolCallStream(tools)
    events = stream.feed(text) + stream.finish()
    content = "".join(value for kind, value in events if kind == "content")
    return content, [value for kind, value in events if kind == "tool_call"]


def parse_call(block: str, schemas: dict[str, dict[str, Any]]) -> ToolCall | None:
    """The call in the text between `<tool_call>` and `</tool_call>`, or None if it is not a
    well-formed call of a known function with distinct parameter names and nothing else inside."""
    match = _FUNCTION.fullmatch(block)
    if match is None or match.group(1).strip() not in schemas:
        return None
    name, body = match.group(1).strip(), match.group(2)
    properties = schemas[name].get("properties") or {}
    arguments: dict[str, Any] = {}
    at = 0
    while True:
        param = _PARAMETER.match(body, at)
        if param is None:
            break
        key = param.group(1).strip()
        if key in arguments:
            return None
        arguments[key] = typed_value(_strip_one_newline(param.group(2)), properties.get(key))
        at = param.end()
    if body[at:].strip():
        return None
    return ToolCall(name, arguments)


def typed_value(value: str, schema: dict[str, Any] | None) -> Any:
    """A parameter's text as the JSON value its schema asks for; the text itself when it does not fit."""
    for kind in _schema_types(schema):
        converted = _convert(value, kind)
        if converted is not _NO:
            return converted
    return value


_NO = object()


def _convert(value: str, kind: str) -> Any:
    text = value.strip()
    if kind == "string":
        return value
    if kind == "integer":
        return int(text) if _INTEGER.fullmatch(text) else _NO
    if kind == "number":
        if _INTEGER.fullmatch(text):
            return int(text)
        try:
            number = float(text)
        except ValueError:
            return _NO
        return number if number == number and abs(number) != float("inf") else _NO
    if kind == "boolean":
        return {"true": True, "false": False}.get(text.lower(), _NO)
    if kind == "null":
        return None if text.lower() in ("null", "none") else _NO
    if kind in ("object", "array"):
        wanted = dict if kind == "object" else list
        for load in (json.loads, ast.literal_eval):  # JSON, else a Python literal ({'a': 1})
            try:
                parsed = load(text)
            except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
                continue
            if isinstance(parsed, wanted):
                return parsed
    return _NO


def _schema_types(schema: dict[str, Any] | None) -> list[str]:
    """The JSON types a property allows, in order ("string" last: it fits anything)."""
    if not isinstance(schema, dict):
        return []
    kinds = schema.get("type")
    found = [kinds] if isinstance(kinds, str) else [k for k in kinds or [] if isinstance(k, str)]
    for key in ("anyOf", "oneOf"):
        for sub in schema.get(key) or []:
            found += _schema_types(sub)
    if not found and "enum" in schema:
        found = sorted({_json_type(v) for v in schema["enum"]}, key=lambda k: k == "string")
    return sorted(dict.fromkeys(found), key=lambda k: k == "string")


def _json_type(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    return "null" if value is None else "string"


def _strip_one_newline(value: str) -> str:
    """The template writes `<parameter=NAME>\\n` + value + `\\n</parameter>`: take one newline off each end."""
    if value.startswith("\n"):
        value = value[1:]
    if value.endswith("\n"):
        value = value[:-1]
    return value


def partial_tag_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper start of `tag` (it may continue into it)."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
