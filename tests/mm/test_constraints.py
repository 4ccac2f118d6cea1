"""Structured outputs and the thinking budget (mm/constraints.py) on the built-in model: random
weights, so the grammar alone makes every output valid. Their strings are bounded (`maxLength`) and
their thinking ended by a budget: random weights close neither by themselves, a property of
grammar-constrained decoding. SCHEMA's name and tags carry their bound in their `pattern` (beside a
pattern, xgrammar would drop maxLength, so such a schema is refused: tests/mm/test_schema_check.py).
Non-ASCII characters in bounded strings (valid UTF-8, counted in code points):
tests/mm/test_constraints_utf8.py."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from lm import SamplingParams, stream_generate
from lm.serving import Engine
from mm import Pipeline
from mm.constraints import BUDGET_CLOSING, BudgetRule, ConstraintError
from mm.default_model import default_model_path

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[a-z ]{0,12}$"},
        "age": {"type": "integer"},
        "score": {"type": "number"},
        "ok": {"type": "boolean"},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string", "pattern": "^[a-z]{0,6}$"}, "maxItems": 3},
        "place": {"type": "object", "properties": {"x": {"type": "integer"}, "label": {"type": "string", "maxLength": 4}},
                  "required": ["x"], "additionalProperties": False},
    },
    "required": ["name", "age", "place"],
    "additionalProperties": False,
}
OTHERS = [  # a batch of different schemas
    {"type": "array", "items": {"type": "integer"}, "maxItems": 4},
    {"enum": ["yes", "no"]},
    {"type": "object", "properties": {"v": {"type": "boolean"}}, "required": ["v"], "additionalProperties": False},
    {"type": "string", "maxLength": 8},
    {"type": "object", "properties": {"n": {"type": "number"}, "s": {"type": "array", "items": {"enum": [1, 2]}}},
     "required": ["n", "s"], "additionalProperties": False},
    {"type": "integer"},
    {"type": "object", "properties": {"deep": {"type": "object", "properties": {"deeper": {"type": "array", "items":
     {"type": "string", "maxLength": 3}, "maxItems": 2}}, "required": ["deeper"], "additionalProperties": False}},
     "required": ["deep"], "additionalProperties": False},
]
HI = [{"role": "user", "content": "Describe a person."}]


@pytest.fixture(scope="module")
def pipeline() -> Pipeline:
    return Pipeline.from_pretrained(default_model_path())


def _params(seed: int, schema=SCHEMA, thinking: bool = False, **more) -> SamplingParams:
    return SamplingParams(max_new_tokens=600, temperature=1.0, seed=seed, json_schema=schema,
                          thinking_budget=6 if thinking else None, **more)  # fmt: skip


def _answers(pipeline, params_list, thinking: bool):
    answers = [pipeline.submit(HI, p, enable_thinking=thinking) for p in params_list]  # together in the batch
    return [a.output() for a in answers]


def _check(output, schema) -> None:
    assert output.finish_reason == "stop", output.text
    jsonschema.validate(json.loads(output.text), schema)
    assert "{" not in output.thinking and "[" not in output.thinking[-5:]  # nothing constrained in the reasoning


@pytest.mark.slow
@pytest.mark.parametrize("thinking", [False, True])
def test_fifty_seeds_validate_against_the_schema(pipeline, thinking):
    for output in _answers(pipeline, [_params(seed, thinking=thinking) for seed in range(50)], thinking):
        _check(output, SCHEMA)
        assert (output.reasoning_tokens > 0) == thinking


def test_a_batch_of_different_schemas_and_a_free_request(pipeline):
    schemas = [SCHEMA, *OTHERS]
    answers = [pipeline.submit(HI, _params(i, s), enable_thinking=False) for i, s in enumerate(schemas)]
    free = pipeline.submit(HI, SamplingParams(max_new_tokens=12, temperature=1.0, seed=3), enable_thinking=False)
    for answer, schema in zip(answers, schemas):
        _check(answer.output(), schema)
    alone = pipeline.generate([HI], SamplingParams(max_new_tokens=12, temperature=1.0, seed=3), enable_thinking=False)
    assert free.output().token_ids == alone[0].token_ids  # a free request beside them is unchanged


@pytest.mark.parametrize("thinking", [False, True])
def test_streamed_and_whole_answers_agree(pipeline, thinking):
    params = _params(7, thinking=thinking)
    pieces = []
    stream = pipeline.stream(HI, params, enable_thinking=thinking)
    while True:
        try:
            pieces.append(next(stream))
        except StopIteration as end:
            streamed = end.value
            break
    whole = pipeline.generate([HI], params, enable_thinking=thinking)[0]
    assert streamed.text == whole.text and streamed.token_ids == whole.token_ids
    _check(whole, SCHEMA)
    assert "".join(pieces).endswith(whole.text)


def test_regex_and_grammar(pipeline):
    out = pipeline.generate([HI], SamplingParams(max_new_tokens=20, temperature=1.0, seed=1, regex=r"ab[0-9]{2}"),
                            enable_thinking=False)[0]  # fmt: skip
    assert out.finish_reason == "stop" and out.text[:2] == "ab" and out.text[2:].isdigit() and len(out.text) == 4
    grammar = 'root ::= ("cat" | "dog") " " [0-9]'
    out = pipeline.generate([HI], SamplingParams(max_new_tokens=20, temperature=1.0, seed=2, grammar=grammar),
                            enable_thinking=False)[0]  # fmt: skip
    assert out.text.split(" ")[0] in ("cat", "dog") and out.text[-1].isdigit() and out.finish_reason == "stop"


@pytest.mark.parametrize("budget", [0, 5, 40])
def test_the_thinking_budget_closes_the_thinking_and_an_answer_follows(pipeline, budget):
    closing = pipeline.processor.tokenizer(BUDGET_CLOSING, add_special_tokens=False)["input_ids"]
    params = SamplingParams(max_new_tokens=budget + len(closing) + 10, temperature=1.0, seed=budget,
                            thinking_budget=budget)  # fmt: skip
    out = pipeline.generate([HI], params, enable_thinking=True)[0]
    assert out.reasoning_tokens <= budget + len(closing)
    assert out.token_ids[out.reasoning_tokens - len(closing) : out.reasoning_tokens] == closing  # random weights
    assert out.completion_tokens > out.reasoning_tokens  # an answer follows
    assert out.thinking.endswith(BUDGET_CLOSING.removesuffix("</think>").strip())
    free = pipeline.generate([HI], SamplingParams(max_new_tokens=20, temperature=0, thinking_budget=3),
                             enable_thinking=False)[0]  # no thinking opened: the budget has nothing to do
    assert free.reasoning_tokens == 0 and free.token_ids == pipeline.generate(
        [HI], SamplingParams(max_new_tokens=20, temperature=0), enable_thinking=False)[0].token_ids


def test_budget_rule_forces_the_closing_only_while_thinking_lasts():
    rule = BudgetRule(3, (90, 91, 99), think_end=99, inner=None)
    assert rule([]) is None and rule([1, 2]) is None
    assert rule([1, 2, 3]).allow == (90,) and rule([1, 2, 3, 90]).allow == (91,) and rule([1, 2, 3, 90, 91]).allow == (99,)
    assert rule([1, 2, 3, 90, 91, 99]) is None and rule([1, 2, 3, 90, 91, 99, 5, 6, 7]) is None
    early = BudgetRule(3, (90, 91, 99), think_end=99, inner=lambda tokens: "inner")
    assert early([1, 99]) == "inner" and early([1, 99, 4, 5, 6]) == "inner"  # closed by the model: never forced


def test_bad_constraints_are_refused_with_the_field_named(pipeline):
    bad = [({"json_schema": {"type": "string", "minLength": 5, "maxLength": 2}}, "json_schema: minLength 5 is greater"),
           ({"json_schema": {"type": "strin"}}, 'json_schema: Unsupported type "strin"'),
           ({"json_schema": "{not json"}, "json_schema: Expecting property name"),
           ({"regex": "("}, "regex: .*parenthesis")]
    for kwargs, message in bad:
        with pytest.raises(ConstraintError, match=message):
            pipeline.generate([HI], SamplingParams(max_new_tokens=5, **kwargs), enable_thinking=False)
    with pytest.raises(ValueError, match="at most one of json_schema, regex and grammar"):
        SamplingParams(json_schema={"type": "integer"}, regex="a")
    with pytest.raises(ValueError, match="thinking_budget must be in"):
        SamplingParams(thinking_budget=-1)
    constrained = SamplingParams(max_new_tokens=4, json_schema={"type": "integer"})
    with pytest.raises(ValueError, match="through mm.Pipeline"):
        Engine(pipeline.model.lm).submit([1, 2, 3], constrained)
    with pytest.raises(ValueError, match="through mm.Pipeline"):
        list(stream_generate(pipeline.model.lm, torch.tensor([[1, 2, 3]]), constrained))
    with pytest.raises(ConstraintError, match="tool_choice cannot"):
        pipeline.constraint_rule(constrained, False, rule=lambda tokens: None)


def test_a_grammar_that_admits_no_token_fails_its_request_alone(pipeline):
    """A string that must hold a raw control character: JSON forbids it unescaped, so no token fits."""
    doomed = pipeline.submit(HI, _params(1, {"type": "string", "pattern": "^\u0001$"}), enable_thinking=False)
    other = pipeline.submit(HI, _params(2), enable_thinking=False)
    with pytest.raises(ConstraintError, match="admits no next token"):
        doomed.output()
    _check(other.output(), SCHEMA)
    assert pipeline.engine.alive


def test_rules_roll_back_to_any_earlier_length(pipeline):
    """A grammar rule inside a thinking budget (the rules speculative drafts are shown to, then
    rolled back: lm/serving/drafts.py): after rollback_to(n), the next masks are those of a rule
    that only ever saw the first n tokens, across the thinking's end and the grammar's start."""
    params = _params(3, thinking=True)
    tokens = pipeline.generate([HI], params, enable_thinking=True)[0].token_ids
    end = tokens.index(pipeline.think_end_id) + 1

    def masks(rule, upto: range) -> list:
        out = []
        for n in upto:
            allowed = rule(tokens[:n])
            out.append(None if allowed is None else allowed.apply(torch.zeros(pipeline.model.lm.config.vocab_size)))
        return out

    walk = range(end - 3, end + 6)
    fresh = masks(pipeline.constraint_rule(params, True), walk)
    rule = pipeline.constraint_rule(params, True)
    masks(rule, range(0, end + 6))  # far ahead, then back before </think> and on again
    rule.rollback_to(end - 3)
    for ours, ref in zip(masks(rule, walk), fresh):
        assert (ours is None and ref is None) or torch.equal(ours, ref)
    rule.rollback_to(end + 2)  # inside the grammar: the matcher rolls back
    assert torch.equal(masks(rule, range(end + 2, end + 3))[0], fresh[5])
