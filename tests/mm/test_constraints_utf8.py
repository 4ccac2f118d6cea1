"""JSON-schema strings bounded in characters (code points, as JSON Schema counts them) come out as
valid UTF-8 (mm/constraints.py, `Surrogates`). Walks through a schema's grammar take, token by
token, a seeded random pick among the tokens the rule allows; most picks aim at a non-ASCII
character, one UTF-8 byte (one token of this byte-level tokenizer) at a time: accented letters, CJK,
Hangul, emoji, other code points of 2, 3 and 4 bytes, and surrogates (U+D800-U+DFFF, which xgrammar
alone would take as one character each: their bytes are no UTF-8 and decode to three U+FFFD)."""

from __future__ import annotations

import json
import random

import jsonschema
import pytest
import xgrammar

from lm import SamplingParams
from lm.sampling import unpack_tokens
from mm.constraints import Grammars
from mm.tokenizer_files import MODEL_VOCAB_SIZE, TOKENIZER_SPECIAL_TOKENS

END_IDS = (TOKENIZER_SPECIAL_TOKENS["<|im_end|>"], TOKENIZER_SPECIAL_TOKENS["<|endoftext|>"])
SCHEMAS = [
    {"type": "string", "minLength": 2, "maxLength": 5},
    {"type": "object", "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 4},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 3}},
     "required": ["name", "tags"], "additionalProperties": False},
]  # fmt: skip
POOL = "éßñ中文字語한국어😀🎉🚀𝄞"  # Hangul's first byte, ED, is the one surrogates begin with
SPANS = [(0x80, 0x7FF), (0x800, 0xFFFF), (0xD800, 0xDFFF), (0x10000, 0x10FFFF)]


@pytest.fixture(scope="module")
def grammars(tokenizer) -> Grammars:
    return Grammars(tokenizer, MODEL_VOCAB_SIZE, END_IDS)


@pytest.fixture(scope="module")
def vocab(tokenizer) -> list[bytes]:
    """Each token's bytes."""
    return xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=MODEL_VOCAB_SIZE).decoded_vocab


@pytest.fixture(scope="module")
def byte_token(vocab) -> dict[int, int]:
    """The token of each single byte."""
    return {text[0]: i for i, text in enumerate(vocab) if len(text) == 1}


def _character(rng: random.Random) -> bytes:
    """The UTF-8 bytes of a character to aim at (a surrogate's in the form xgrammar would take)."""
    if rng.random() < 0.4:
        return rng.choice(POOL).encode()
    low, high = rng.choice(SPANS)
    code = rng.randint(low, high)
    return chr(code if code != 0xFFFD else 0xFFFC).encode("utf-8", "surrogatepass")


def _walk(grammars: Grammars, schema: dict, rng: random.Random, byte_token: dict[int, int],
          counts: dict[str, int]) -> list[int]:  # fmt: skip
    """The tokens of one answer under `schema`, each a random pick among those the rule allows."""
    rule = grammars.rule(SamplingParams(json_schema=schema), in_thinking=False, think_end=None)
    tokens: list[int] = []
    aim: list[int] = []  # the byte tokens of the character aimed at, still to come
    while (step := rule(tokens)).allow is None:  # until the grammar is complete (then only the end)
        if not aim and rng.random() < 0.75:
            character = _character(rng)
            aim = [byte_token[b] for b in character]
            counts["surrogates aimed at"] += character[:1] == b"\xed" and character[1] >= 0xA0
        allowed = unpack_tokens(step.bits, MODEL_VOCAB_SIZE)
        if aim and bool(allowed[aim[0]]):
            tokens.append(aim.pop(0))
        else:  # not allowed here (a surrogate, or the string is full): a random pick instead
            aim = []
            token = rng.choice(allowed.nonzero().flatten().tolist())
            if token in END_IDS:  # the end of the turn, once the grammar may end
                return tokens
            tokens.append(token)
    return tokens


@pytest.mark.parametrize("schema", SCHEMAS, ids=["string", "object"])
def test_bounded_strings_are_valid_utf8_counted_in_code_points(grammars, vocab, byte_token, schema):
    rng, counts, seen = random.Random(20), {"surrogates aimed at": 0}, set()
    for _ in range(120):
        tokens = _walk(grammars, schema, rng, byte_token, counts)
        text = b"".join(vocab[t] for t in tokens).decode("utf-8")  # strict: raises on invalid UTF-8
        value = json.loads(text)
        jsonschema.validate(value, schema)  # minLength / maxLength in code points
        seen.update(text)
    assert {len(c.encode()) for c in seen} == {1, 2, 3, 4}, sorted(seen)
    for low, high in [(0x4E00, 0x9FFF), (0xAC00, 0xD7A3), (0x1F300, 0x1FAFF)]:  # CJK, Hangul, emoji
        assert any(low <= ord(c) <= high for c in seen), sorted(seen)
    assert counts["surrogates aimed at"] >= 20, counts


def test_a_surrogate_is_masked_where_a_valid_character_is_not(grammars, byte_token):
    """After '"' and byte ED, a continuation 80-9F makes U+D000-U+D7FF (Hangul and more); A0-BF
    would make a surrogate."""
    rule = grammars.rule(SamplingParams(json_schema={"type": "string", "maxLength": 2}), in_thinking=False,
                         think_end=None)  # fmt: skip
    mask = unpack_tokens(rule([byte_token[ord('"')], byte_token[0xED]]).bits, MODEL_VOCAB_SIZE)
    assert all(mask[byte_token[b]] for b in range(0x80, 0xA0))
    assert not any(mask[byte_token[b]] for b in range(0xA0, 0xC0))
    assert unpack_tokens(rule([byte_token[b] for b in '"한'.encode()]).bits, MODEL_VOCAB_SIZE)[byte_token[ord('"')]]
