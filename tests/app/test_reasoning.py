"""The reasoning / content split (vLLM's qwen3 reasoning parser), whole and cut at every boundary."""

from __future__ import annotations

import pytest

from app.reasoning import ReasoningStream, prompt_opens_thinking, split_reasoning
from mm import split_thinking

CASES = [
    (True, "Let me think.\nStep 2.\n\n</think>\n\nThe answer is 4.\n"),
    (True, "<think>\nplanning\n</think>\n\nanswer"),  # the model opened the block itself
    (True, "\n\nstill thinking when the tokens ran out\n\n"),
    (True, "</think>\n\nno thinking at all"),
    (True, "a </thi nk> b</think>c"),
    (False, "Direct answer\n\nwith newlines\n"),
    (False, ""),
]


def _streamed(pieces: list[str], in_thinking: bool) -> tuple[str, str]:
    stream = ReasoningStream(in_thinking)
    parts = [p for piece in pieces for p in stream.feed(piece)] + stream.finish()
    assert all(text for _, text in parts)  # no empty deltas
    return "".join(t for k, t in parts if k == "reasoning"), "".join(t for k, t in parts if k == "content")


@pytest.mark.parametrize("in_thinking, text", CASES)
def test_split_matches_mm_split_thinking(in_thinking, text):
    assert split_reasoning(text, in_thinking) == split_thinking(text, in_thinking=in_thinking)


@pytest.mark.parametrize("in_thinking, text", CASES)
def test_every_split_gives_the_same(in_thinking, text):
    whole = split_reasoning(text, in_thinking)
    for cut in range(len(text) + 1):
        assert _streamed([text[:cut], text[cut:]], in_thinking) == whole, cut
    assert _streamed(list(text), in_thinking) == whole  # one character at a time


def test_thinking_off_never_yields_reasoning():
    assert split_reasoning("x</think>y", in_thinking=False) == ("", "x</think>y")


def test_prompt_opens_thinking():
    assert prompt_opens_thinking("<|im_start|>assistant\n<think>\n")
    assert not prompt_opens_thinking("<|im_start|>assistant\n<think>\n\n</think>\n\n")
