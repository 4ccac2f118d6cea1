"""The server's answer deltas: thinking, then content and tool calls, the same streamed or whole."""

from __future__ import annotations

import json

from app.serve_response import AnswerStream, completion, finish_reason, message
from mm import Output
from tests.app.test_tool_calls import CALLS, TOOLS, _model_output


def _deltas(pieces: list[str], **options) -> tuple[list[dict], int]:
    answer = AnswerStream(**options)
    deltas = [d for piece in pieces for d in answer.feed(piece)] + answer.finish()
    assert all(any(d.values()) for d in deltas)  # no empty deltas
    return deltas, answer.calls


def _output(reason: str = "stop") -> Output:
    return Output("", "", [1, 2, 3], prompt_tokens=10, completion_tokens=3, finish_reason=reason)


def test_thinking_then_tool_calls_streamed_token_by_token(tokenizer):
    text = "I should look up the weather.\n</think>\n\n" + _model_output(tokenizer, CALLS, content="One moment.")
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    pieces = [tokenizer.decode(ids[i : i + 1]) for i in range(len(ids))]
    streamed, calls = _deltas(pieces, in_thinking=True, tools=TOOLS)
    whole, _ = _deltas([text], in_thinking=True, tools=TOOLS)
    assert calls == 2
    streamed_message, whole_message = message(streamed), message(whole)
    reasoning = "I should look up the weather."
    assert streamed_message["reasoning_content"] == whole_message["reasoning_content"] == reasoning
    assert streamed_message["content"] == whole_message["content"] == "One moment."
    assert [d["tool_calls"][0]["function"] for d in whole if "tool_calls" in d] == \
        [d["tool_calls"][0]["function"] for d in streamed if "tool_calls" in d]
    tool_deltas = [d["tool_calls"][0] for d in streamed if "tool_calls" in d]
    assert [d["index"] for d in tool_deltas] == [0, 1]
    assert [(d["function"]["name"], json.loads(d["function"]["arguments"])) for d in tool_deltas] == CALLS
    assert all("index" not in c for c in streamed_message["tool_calls"])
    assert finish_reason(_output("stop"), calls) == "tool_calls"
    assert finish_reason(_output("length"), calls) == "length"


def test_without_tools_the_xml_is_content(tokenizer):
    text = _model_output(tokenizer, CALLS[:1])
    deltas, calls = _deltas([text], in_thinking=False, tools=[])
    assert calls == 0 and message(deltas) == {"role": "assistant", "content": text, "reasoning_content": None}


def test_hidden_reasoning_and_the_completion_body():
    deltas, calls = _deltas(["secret\n</think>\n\nanswer"], in_thinking=True, tools=[], include_reasoning=False)
    body = completion("chatcmpl-1", "default", 0, deltas, _output("stop"), calls)
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "answer", "reasoning_content": None}
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"] == {"prompt_tokens": 10, "completion_tokens": 3, "total_tokens": 13,
                             "completion_tokens_details": {"reasoning_tokens": 0}}
