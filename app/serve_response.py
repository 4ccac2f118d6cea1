"""Generated text to OpenAI chat-completion messages, deltas and chunks.

`AnswerStream` turns the pipeline's text pieces into deltas: first the reasoning split
(`reasoning_content`), then, in the content, the tool calls. A non-streamed answer is the same
deltas joined, so both ways give the same message for the same generated text.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

from mm import Output

from .reasoning import ReasoningStream
from .tool_calls import ToolCallStream

Delta = dict[str, Any]


class AnswerStream:
    """Deltas of one answer ({"reasoning_content"}, {"content"}, {"tool_calls": [...]}), piece by piece."""

    def __init__(self, *, in_thinking: bool, tools: list[dict[str, Any]], include_reasoning: bool = True):
        self.reasoning = ReasoningStream(in_thinking)
        self.tools = ToolCallStream(tools) if tools else None
        self.include_reasoning = include_reasoning
        self.calls = 0

    def feed(self, piece: str) -> list[Delta]:
        return self._deltas(self.reasoning.feed(piece))

    def finish(self) -> list[Delta]:
        deltas = self._deltas(self.reasoning.finish())
        if self.tools is not None:
            deltas += self._tool_deltas(self.tools.finish())
        return _merge(deltas)

    def _deltas(self, parts: list[tuple[str, str]]) -> list[Delta]:
        deltas: list[Delta] = []
        for kind, text in parts:
            if kind == "reasoning":
                if self.include_reasoning:
                    deltas.append({"reasoning_content": text})
            elif self.tools is None:
                deltas.append({"content": text})
            else:
                deltas += self._tool_deltas(self.tools.feed(text))
        return _merge(deltas)

    def _tool_deltas(self, events: list[tuple[str, Any]]) -> list[Delta]:
        deltas: list[Delta] = []
        for kind, value in events:
            if kind == "content":
                deltas.append({"content": value})
            else:
                deltas.append({"tool_calls": [value.to_openai(self.calls)]})
                self.calls += 1
        return deltas


def _merge(deltas: list[Delta]) -> list[Delta]:
    """Join neighbouring text deltas of the same kind."""
    merged: list[Delta] = []
    for delta in deltas:
        last = merged[-1] if merged else None
        key = next(iter(delta))
        if last is not None and key in ("content", "reasoning_content") and set(last) == {key}:
            last[key] += delta[key]
        else:
            merged.append(dict(delta))
    return merged


def message(deltas: list[Delta]) -> dict[str, Any]:
    """The assistant message of a whole answer, from all its deltas."""
    content = "".join(d.get("content", "") for d in deltas)
    reasoning = "".join(d.get("reasoning_content", "") for d in deltas)
    calls = [{k: v for k, v in call.items() if k != "index"} for d in deltas for call in d.get("tool_calls", [])]
    out: dict[str, Any] = {"role": "assistant", "content": content if content or not calls else None,
                           "reasoning_content": reasoning or None}  # fmt: skip
    if calls:
        out["tool_calls"] = calls
    return out


def finish_reason(output: Output, calls: int) -> str:
    """OpenAI's finish reason: "tool_calls" when the answer ended after calling tools."""
    return "tool_calls" if calls and output.finish_reason == "stop" else output.finish_reason


def usage(output: Output) -> dict[str, Any]:
    return {"prompt_tokens": output.prompt_tokens, "completion_tokens": output.completion_tokens,
            "total_tokens": output.prompt_tokens + output.completion_tokens,
            "completion_tokens_details": {"reasoning_tokens": output.reasoning_tokens}}  # fmt: skip


def logprobs_content(entries, decode: Callable[[int], str]) -> dict[str, Any]:
    """OpenAI's `logprobs` of a choice (or a chunk) from (id, log-probability, alternatives) entries:
    every completion token's, the thinking's too; `decode` gives a token id's text."""
    def item(token: int, logprob: float) -> dict[str, Any]:
        text = decode(token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return {"content": [{**item(token, lp), "top_logprobs": [item(t, v) for t, v in top]} for token, lp, top in entries]}


def completion(rid: str, model: str, created: int, deltas: list[Delta], output: Output, calls: int,
               decode: Callable[[int], str] | None = None) -> dict[str, Any]:  # fmt: skip
    """The non-streamed response body (`decode`: a token id's text, for logprobs)."""
    logprobs = None if output.logprobs is None or decode is None else logprobs_content(output.logprobs, decode)
    choice = {"index": 0, "message": message(deltas), "finish_reason": finish_reason(output, calls), "logprobs": logprobs}
    return {"id": rid, "object": "chat.completion", "created": created, "model": model, "choices": [choice],
            "usage": usage(output)}  # fmt: skip


def chunk(rid: str, model: str, created: int, delta: Delta | None, finish: str | None = None,
          usage_: dict[str, int] | None = None, with_usage: bool = False,
          logprobs: dict[str, Any] | None = None) -> dict[str, Any]:  # fmt: skip
    """One streamed chunk: a delta (or the finish reason), or, with `delta=None`, the final usage chunk."""
    body: dict[str, Any] = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model}
    if delta is None:
        body["choices"] = []
    else:
        body["choices"] = [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": logprobs}]
    if with_usage:
        body["usage"] = usage_
    return body


def event(body: dict[str, Any]) -> str:
    """One server-sent event of a JSON body."""
    return f"data: {json.dumps(body, ensure_ascii=False, separators=(',', ':'))}\n\n"


class LogprobsCursor:
    """The logprobs of a streamed answer's tokens not yet sent, chunk by chunk."""

    def __init__(self, decode: Callable[[int], str]):
        self.decode, self.sent = decode, 0

    def next(self, request) -> dict[str, Any]:
        """The `logprobs` of the engine request's tokens since the last call."""
        entries = [(t, lp, top) for t, (lp, top) in zip(request.tokens[self.sent :], request.logprobs[self.sent :])]
        self.sent += len(entries)
        return logprobs_content(entries, self.decode)


def now() -> int:
    return int(time.time())
