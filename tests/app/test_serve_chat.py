"""Requests to what the model runs: sampling parameters, template variables, messages, error places."""

from __future__ import annotations

import json

import pytest

from app.openai_protocol import APIError, parse_request
from app.serve_chat import NAMED_TOOL_NOTE, ChatJob, Limits, build_conversation, sampling_params, template_inputs
from app.serve_chat import tool_note
from lm import SamplingParams

TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}},
         {"type": "function", "function": {"name": "g"}}]  # fmt: skip


def _request(**fields):
    return parse_request(json.dumps({"model": "m", "messages": [{"role": "user", "content": "Hi"}], **fields}).encode())


def test_sampling_params_over_the_checkpoint_defaults():
    defaults = SamplingParams(max_new_tokens=99, temperature=1.0, top_p=0.95, top_k=20, presence_penalty=1.5)
    params = sampling_params(_request(temperature=0.2, top_k=-1, stop="END", seed=3), defaults, 1000, Limits())
    assert (params.temperature, params.top_k, params.top_p, params.stop, params.seed) == (0.2, 0, 0.95, ("END",), 3)
    assert params.presence_penalty == 1.5 and params.max_new_tokens == 500  # half the context of 1000
    both = sampling_params(_request(max_completion_tokens=7, max_tokens=9), defaults, 1000, Limits())
    assert both.max_new_tokens == 7
    with pytest.raises(APIError, match="stop strings must not be empty"):
        sampling_params(_request(stop=[""]), defaults, 1000, Limits())
    with pytest.raises(APIError, match="only allowed with stream"):
        sampling_params(_request(stream_options={"include_usage": True}), defaults, 1000, Limits())


def test_template_inputs_tools_and_choices():
    thinking, kwargs, tools = template_inputs(_request(chat_template_kwargs={"enable_thinking": False,
                                                                            "preserve_thinking": True}))  # fmt: skip
    assert thinking is False and kwargs == {"preserve_thinking": True} and tools == []
    _, kwargs, tools = template_inputs(_request(tools=TOOLS))
    assert [t["function"]["name"] for t in kwargs["tools"]] == ["f", "g"] and tools == kwargs["tools"]
    _, kwargs, tools = template_inputs(_request(tools=TOOLS, tool_choice="none"))
    assert "tools" not in kwargs and tools == []
    named = _request(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "g"}})
    _, kwargs, tools = template_inputs(named)
    assert [t["function"]["name"] for t in tools] == ["g"] and tool_note(named) == NAMED_TOOL_NOTE.format(name="g")
    with pytest.raises(APIError, match="may not set"):
        template_inputs(_request(chat_template_kwargs={"tools": []}))
    with pytest.raises(APIError, match="same function name"):
        template_inputs(_request(tools=TOOLS + TOOLS[:1]))


def test_messages_and_where_errors_point():
    request = _request(messages=[{"role": "developer", "content": [{"type": "text", "text": "Be brief."}]},
                                 {"role": "user", "content": [{"type": "text", "text": "Hi"}]},
                                 {"role": "assistant", "content": "Hello", "reasoning": "greeting"},
                                 {"role": "user", "content": "More"}])  # fmt: skip
    conversation = build_conversation(request, Limits(), "Call a tool.", {})
    assert conversation[0] == {"role": "system", "content": "Be brief.\n\nCall a tool."}
    assert conversation[1]["content"] == [{"type": "text", "text": "Hi"}]
    assert conversation[2] == {"role": "assistant", "content": "Hello", "reasoning_content": "greeting"}
    assert build_conversation(_request(), Limits(), "Note.", {})[0] == {"role": "system", "content": "Note."}
    job = ChatJob(conversation, SamplingParams(), None, {}, [], True, added_messages=1)
    assert job.where("conversation 0, message 2, part 0: bad image") == "messages[1].content[0]: bad image"
    assert job.where("conversation 0, message 3: x") == "messages[2]: x"
