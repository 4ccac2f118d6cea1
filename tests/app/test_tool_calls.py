"""The Qwen3 XML tool-call parser on calls rendered by the real chat template, cut at every boundary."""

from __future__ import annotations

import random

import pytest

from app.tool_calls import ToolCallStream, parse_call, parse_tool_calls, typed_value
from mm.chat import DEFAULT_CHAT_TEMPLATE_PATH, render

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city", "parameters": {
        "type": "object", "required": ["city"], "properties": {
            "city": {"type": "string"}, "days": {"type": "integer"}, "celsius": {"type": "boolean"},
            "threshold": {"type": "number"}, "hours": {"type": "array", "items": {"type": "integer"}},
            "where": {"type": "object"}, "note": {"type": ["string", "null"]}}}}},
    {"type": "function", "function": {"name": "search", "parameters": {
        "type": "object", "properties": {"query": {"type": "string"}, "limit": {"type": ["integer", "null"]}}}}},
]  # fmt: skip
CALLS = [
    ("get_weather", {"city": "Paris\nFrance", "days": 3, "celsius": True, "threshold": 2.5, "hours": [6, 12],
                     "where": {"lat": 48.85, "lon": 2.35}, "note": None}),
    ("search", {"query": "  spaced <b>bold</b> text ", "limit": 10}),
]  # fmt: skip


def _model_output(tokenizer, calls, content: str = "") -> str:
    """What the model is trained to write for `calls`: the real template's rendering of an assistant
    turn with those tool calls (the text after `<|im_start|>assistant\\n<think>...</think>\\n\\n`)."""
    message = {"role": "assistant", "content": content,
               "tool_calls": [{"type": "function", "function": {"name": n, "arguments": a}} for n, a in calls]}
    template = DEFAULT_CHAT_TEMPLATE_PATH.read_text()
    text = render(tokenizer, template, [{"role": "user", "content": "Hi"}, message], 0,
                  add_generation_prompt=False, enable_thinking=None, template_kwargs={"tools": TOOLS})  # fmt: skip
    turn = text.split("<|im_start|>assistant\n")[-1]
    return turn.split("</think>\n\n", 1)[1].removesuffix("<|im_end|>\n")


def _streamed(pieces: list[str], tools=TOOLS) -> tuple[str, list]:
    stream = ToolCallStream(tools)
    events = [e for piece in pieces for e in stream.feed(piece)] + stream.finish()
    return "".join(v for k, v in events if k == "content"), [v for k, v in events if k == "tool_call"]


def _same(a, b) -> bool:
    return a[0] == b[0] and [(c.name, c.arguments) for c in a[1]] == [(c.name, c.arguments) for c in b[1]]


def test_template_rendered_calls_parse_back_typed(tokenizer):
    text = _model_output(tokenizer, CALLS, content="Let me look that up.")
    assert text.startswith("Let me look that up.\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis")
    content, calls = parse_tool_calls(text, TOOLS)
    assert content == "Let me look that up."
    assert [(c.name, c.arguments) for c in calls] == CALLS
    assert len({c.id for c in calls}) == 2 and all(c.id.startswith("call_") for c in calls)
    entry = calls[0].to_openai(index=0)
    assert entry["index"] == 0 and entry["type"] == "function" and entry["function"]["name"] == "get_weather"
    assert '"days": 3' in entry["function"]["arguments"]


def test_every_split_and_token_by_token_give_the_same(tokenizer):
    text = _model_output(tokenizer, CALLS, content="Checking.") + "\n"
    whole = parse_tool_calls(text, TOOLS)
    for cut in range(len(text) + 1):  # one boundary anywhere, inside every tag
        assert _same(_streamed([text[:cut], text[cut:]]), whole), cut
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    pieces = [tokenizer.decode(ids[i : i + 1]) for i in range(len(ids))]
    assert "".join(pieces) == text and len(pieces) > 20
    assert _same(_streamed(pieces), whole)
    rng = random.Random(0)
    for _ in range(50):
        cuts = sorted(rng.sample(range(1, len(text)), 6))
        assert _same(_streamed([text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]), whole)


def test_content_only_passes_through_unchanged():
    for text in ["Plain answer.\n\n", "a < b and <tool it is", "x </tool_call> y", "  lead\n", ""]:
        for cut in range(len(text) + 1):
            assert _streamed([text[:cut], text[cut:]]) == (text, [])


@pytest.mark.parametrize("block", [
    "<tool_call>\n<function=unknown_fn>\n<parameter=a>\n1\n</parameter>\n</function>\n</tool_call>",
    "<tool_call>\n<function=search>\n<parameter=query>\nx\n</parameter>\n</tool_call>",  # no </function>
    "<tool_call>\n<function=search>\njunk\n<parameter=query>\nx\n</parameter>\n</function>\n</tool_call>",
    "<tool_call>\n<function=search>\n<parameter=query>\na\n</parameter>\n<parameter=query>\nb\n</parameter>\n"
    "</function>\n</tool_call>",  # the same parameter twice
    "<tool_call>\nsearch(query='x')\n</tool_call>",
    "<tool_call>\n<function=search>\n<parameter=query>\nnever closed",  # generation stopped inside the call
])  # fmt: skip
def test_malformed_calls_come_back_as_content(block):
    text = "Sure.\n" + block
    for cut in range(0, len(text) + 1, 3):
        content, calls = _streamed([text[:cut], text[cut:]])
        assert calls == [] and content == text


def test_valid_call_between_text_and_a_malformed_one():
    good = "<tool_call>\n<function=search>\n<parameter=query>\ncats\n</parameter>\n</function>\n</tool_call>"
    bad = "<tool_call>\n<function=nope>\n</function>\n</tool_call>"
    content, calls = parse_tool_calls(f"Intro\n\n{good}\n{bad} tail", TOOLS)
    assert [(c.name, c.arguments) for c in calls] == [("search", {"query": "cats"})]
    assert content == f"Intro{bad} tail"


def test_typed_values_follow_the_schema():
    assert typed_value("42", {"type": "integer"}) == 42
    assert typed_value("forty", {"type": "integer"}) == "forty"  # does not fit: the model's text stays
    assert typed_value("1e3", {"type": "number"}) == 1000.0 and typed_value("7", {"type": "number"}) == 7
    assert typed_value("True", {"type": "boolean"}) is True
    assert typed_value("null", {"type": ["integer", "null"]}) is None
    assert typed_value("{'a': [1, 2]}", {"type": "object"}) == {"a": [1, 2]}  # a Python literal
    assert typed_value("[1, 2", {"type": "array"}) == "[1, 2"
    assert typed_value("007", None) == "007"  # no schema: a string
    assert typed_value("3", {"anyOf": [{"type": "string"}, {"type": "integer"}]}) == 3
    assert typed_value("b", {"enum": ["a", "b"]}) == "b"
    assert parse_call("\n<function=search>\n</function>\n", {"search": {}}).arguments == {}
