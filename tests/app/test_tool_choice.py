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


TYPED = {"type": "function", "function": {"name": "plan_trip", "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}, "budget": {"type": "number", "minimum": 0, "maximum": 1e6}, "hotel": {"type": "boolean"},
    "unit": {"enum": ["metric", "imperial"]}, "stops": {"type": "array", "items": {"type": "integer"}, "maxItems": 3},
    "where": {"type": "object", "properties": {"lat": {"type": "number", "minimum": -90, "maximum": 90},
                                                "lon": {"type": "number", "minimum": -180, "maximum": 180}},
              "required": ["lat", "lon"], "additionalProperties": False}},
    "required": ["city", "days", "unit", "where"]}}}  # fmt: skip


@pytest.mark.slow
def test_typed_parameters_follow_their_schema_under_random_weights(pipeline):
    """Every call of the random model validates against the tool's schema: each typed value is
    written under its grammar, every required parameter is there (strings are free text, closed after
    `value_tokens`). The numbers are bounded: JSON lets an unbounded one take any exponent, which a
    float cannot hold, and random weights write such exponents."""
    import jsonschema

    from lm import SamplingParams

    tokenizer, schema = pipeline.processor.tokenizer, TYPED["function"]["parameters"]
    conversation = [{"role": "user", "content": "Plan a trip."}]
    answers = []
    for seed in range(8):
        rule = ToolCallRule(tokenizer, [TYPED], pipeline.model.eos_token_ids(), in_thinking=False, value_tokens=6,
                            max_tokens=400, grammars=pipeline.grammars)  # fmt: skip
        answers.append(pipeline.submit(conversation, SamplingParams(max_new_tokens=400, temperature=1.0, seed=seed),
                                       enable_thinking=False, template_kwargs={"tools": [TYPED]}, rule=rule))  # fmt: skip
    for answer in answers:
        out = answer.output()
        _, [call] = parse_tool_calls(out.text, [TYPED])
        assert call.name == "plan_trip" and out.finish_reason == "stop", out.text
        jsonschema.validate(call.arguments, schema)


def test_a_bad_parameter_schema_is_refused_by_name(pipeline):
    from mm.constraints import ConstraintError

    bad = {"type": "function", "function": {"name": "f", "parameters": {"properties": {"n": {"type": "intger"}}}}}
    with pytest.raises(ConstraintError, match='Unsupported type "intger"'):
        ToolCallRule(pipeline.processor.tokenizer, [bad], (1,), in_thinking=False, grammars=pipeline.grammars)
