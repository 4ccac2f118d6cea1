"""mm/schema_check.py: a schema keyword xgrammar does not enforce is refused, naming it; the ones it
enforces pass. Each case is checked against xgrammar itself (its grammar accepts, or refuses, an
instance that breaks only that keyword), so a release that changes the answer fails here."""

from __future__ import annotations

import json

import jsonschema
import pytest
import xgrammar

from lm import SamplingParams
from mm.constraints import ConstraintError, Grammars
from mm.processor import Processor
from mm.default_model import default_model_path
from mm.schema_check import unenforced
from mm.tokenizer_files import MODEL_VOCAB_SIZE

INTS = {"type": "integer"}
# (schema, an instance that breaks only the keyword, what the refusal names)
UNENFORCED = [
    ({"type": "array", "items": INTS, "uniqueItems": True}, [1, 1], "uniqueItems at #"),
    ({"type": "array", "items": {}, "contains": {"type": "string"}}, [1], "contains at #"),
    ({"type": "object", "properties": {"a": INTS, "b": INTS}, "dependentRequired": {"a": ["b"]}}, {"a": 1},
     "dependentRequired"),
    ({"type": "object", "properties": {"a": INTS, "b": INTS}, "dependentSchemas": {"a": {"required": ["b"]}}},
     {"a": 1}, "dependentSchemas"),
    ({"type": "object", "properties": {"v": {"not": {"type": "string"}}}}, {"v": "a"}, "not at #/properties/v"),
    ({"if": {"type": "string"}, "then": {"maxLength": 1}}, "ab", "if at #"),
    ({"allOf": [{"type": "object", "properties": {"a": INTS}, "required": ["a"]},
                {"type": "object", "properties": {"a": {"type": "integer", "minimum": 3}}}]}, {"a": 1}, "allOf of 2"),
    ({"oneOf": [INTS, {"type": "number"}]}, 1, "oneOf at #"),
    ({"type": "string", "pattern": "^a+$", "maxLength": 2}, "aaa", "maxLength beside pattern"),
    ({"type": "string", "format": "email", "maxLength": 5}, "abc@de.fg", "maxLength beside format"),
    ({"type": "array", "items": {"maxLength": 2}}, ["abc"], "maxLength at #/items needs a type"),
    ({"minimum": 2}, 1, "minimum at # needs a type"),
    ({"type": "number", "multipleOf": 0.5}, 1.2, "multipleOf on a number"),
]
# (schema, an instance that breaks only the keyword): enforced, so taken
ENFORCED = [
    ({"type": "string", "maxLength": 2}, "abc"),
    ({"type": "string", "minLength": 2}, "a"),
    ({"type": "string", "pattern": "^a{0,2}$"}, "aaa"),
    ({"type": "string", "format": "date"}, "x"),
    ({"type": ["string", "null"], "maxLength": 2}, "abc"),
    ({"type": "integer", "minimum": 3, "exclusiveMaximum": 5}, 5),
    ({"type": "number", "exclusiveMinimum": 0}, 0),
    ({"type": "integer", "multipleOf": 3}, 4),
    ({"type": "array", "items": INTS, "minItems": 2, "maxItems": 3}, [1]),
    ({"type": "array", "prefixItems": [INTS], "items": False}, ["a"]),
    ({"type": "object", "additionalProperties": INTS, "maxProperties": 1}, {"a": 1, "b": 2}),
    ({"type": "object", "patternProperties": {"^a": INTS}}, {"a": "x"}),
    ({"type": "object", "propertyNames": {"pattern": "^a"}}, {"b": 1}),
    ({"oneOf": [INTS, {"type": "boolean"}]}, "a"),
    ({"allOf": [{"type": "integer", "minimum": 3}]}, 2),
    ({"$defs": {"i": INTS}, "$ref": "#/$defs/i"}, "a"),
    ({"uniqueItems": False, "type": "array", "items": INTS}, ["a"]),
    ({"enum": ["a", 1, None]}, 2),
]


@pytest.fixture(scope="module")
def grammars() -> Grammars:
    tokenizer = Processor.from_pretrained(default_model_path()).tokenizer
    return Grammars(tokenizer, MODEL_VOCAB_SIZE, tokenizer.convert_tokens_to_ids(["<|im_end|>"]))


def _accepts(schema: dict, instance) -> bool:
    """Whether xgrammar's grammar of `schema` (compact, strict, as mm/constraints.py compiles it) takes `instance`."""
    grammar = xgrammar.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False, separators=(",", ":"),
                                                strict_mode=True)  # fmt: skip
    matcher = xgrammar.GrammarMatcher(xgrammar.GrammarCompiler(_INFO).compile_grammar(grammar))
    return matcher.accept_string(json.dumps(instance, separators=(",", ":"))) and matcher.is_completed()


_INFO = xgrammar.TokenizerInfo([])  # a byte-level grammar walk needs no vocabulary


@pytest.mark.parametrize("schema, instance, named", UNENFORCED, ids=[c[2].split()[0] for c in UNENFORCED])
def test_a_keyword_the_grammar_drops_is_refused_by_name(grammars, schema, instance, named):
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(instance, schema, format_checker=jsonschema.FormatChecker())
    assert _accepts(schema, instance), "xgrammar enforces this keyword now: take it off mm/schema_check.py"
    assert named in unenforced(schema)
    with pytest.raises(ConstraintError, match=f"json_schema: {named}"):
        grammars.compile(SamplingParams(json_schema=schema))


@pytest.mark.parametrize("schema, instance", ENFORCED, ids=[json.dumps(c[0])[:40] for c in ENFORCED])
def test_a_keyword_the_grammar_enforces_is_taken(grammars, schema, instance):
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(instance, schema, format_checker=jsonschema.FormatChecker())
    assert not _accepts(schema, instance)
    assert unenforced(schema) is None
    grammars.compile(SamplingParams(json_schema=schema))


def test_a_tool_parameter_with_a_dropped_keyword_is_refused(grammars):
    with pytest.raises(ConstraintError, match="uniqueItems at #"):
        grammars.value_grammar({"type": "array", "items": INTS, "uniqueItems": True})
