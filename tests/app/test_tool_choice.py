"""tool_choice enforced while decoding (app/tool_choice.py): a model that would close the call at
once still gives every parameter its schema requires (issue 43: `{}` for a required `city`)."""

from __future__ import annotations

import pytest

from app import default_model_path
from app.tool_calls import parse_tool_calls
from app.tool_choice import ToolCallRule
from mm import Processor

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "unit": {"type": "string"}}, "required": ["city"]}}}


@pytest.fixture(scope="module")
def tokenizer():
    return Processor.from_pretrained(default_model_path()).tokenizer


def _eager_to_close(tokenizer, rule: ToolCallRule, value: str = "Paris") -> str:
    """Decode under `rule` as a model that ends the call whenever it may: the closing tag's first
    token when allowed, else the first allowed token; a value is `value`."""
    encode = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    close, tokens = encode("</function>")[0], []
    for _ in range(200):
        allowed = rule(tokens)
        if allowed.allow is None:  # inside a value
            tokens += encode(f"{value}\n</parameter>")
        elif set(allowed.allow) == set(rule.end_ids):
            break
        else:
            tokens.append(close if close in allowed.allow else allowed.allow[0])
    return tokenizer.decode(tokens, skip_special_tokens=False)


def test_required_parameters_are_given_and_none_twice(tokenizer):
    rule = ToolCallRule(tokenizer, [WEATHER], end_ids=(tokenizer.eos_token_id,), in_thinking=False)
    _, [call] = parse_tool_calls(_eager_to_close(tokenizer, rule), [WEATHER])
    assert call.name == "get_weather" and call.arguments == {"city": "Paris"}
    optional = {**WEATHER, "function": {**WEATHER["function"], "parameters": {"properties": {"city": {}}}}}
    rule = ToolCallRule(tokenizer, [optional], end_ids=(tokenizer.eos_token_id,), in_thinking=False)
    assert parse_tool_calls(_eager_to_close(tokenizer, rule), [optional])[1][0].arguments == {}


def test_a_required_list_that_is_not_one_is_refused(tokenizer):
    bad = {"type": "function", "function": {"name": "f", "parameters": {"required": "city"}}}
    with pytest.raises(ValueError, match="'f': parameters.required must be a list"):
        ToolCallRule(tokenizer, [bad], end_ids=(1,), in_thinking=False)
