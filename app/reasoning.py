"""The thinking of a generated answer, apart from the answer: OpenAI-style `reasoning_content`.

As vLLM's `qwen3` reasoning parser: when the prompt left a `<think>` block open (Qwen3.5's thinking
mode; the generation prompt ends with `<think>\\n`), the text up to the first `</think>` is the
reasoning and the rest is the content. Without an open block (`enable_thinking: false`) everything
is content. Like `mm.split_thinking`, newlines around the reasoning and at the start of the content
are dropped, and a `<think>` the model writes itself at the start is not part of the reasoning.

`ReasoningStream` gives the same split for every way of cutting the text into pieces.
"""

from __future__ import annotations

from .tool_calls import partial_tag_suffix

THINK_START = "<think>"
THINK_END = "</think>"

Part = tuple[str, str]  # ("reasoning" | "content", text)


def prompt_opens_thinking(prompt: str) -> bool:
    """The rendered prompt ends inside a `<think>` block, which the model is expected to close."""
    return prompt.rstrip().endswith(THINK_START)


class ReasoningStream:
    """Splits generated text into reasoning and content, piece by piece."""

    def __init__(self, in_thinking: bool):
        self.in_thinking = in_thinking
        self.buffer = ""  # reasoning text not yet decided (a possible tag start, trailing newlines)
        self.started = False  # some reasoning text (not newlines, not the opening tag) was seen
        self.content_started = not in_thinking  # leading newlines of the content are dropped until then

    def feed(self, text: str) -> list[Part]:
        """Parts for `text`, the next piece of generated text."""
        if not self.in_thinking:
            return self._content(text)
        self.buffer += text
        end = self.buffer.find(THINK_END)
        if end >= 0:
            reasoning, rest = self.buffer[:end], self.buffer[end + len(THINK_END) :]
            self.buffer, self.in_thinking = "", False
            return self._reasoning(reasoning, final=True) + self._content(rest)
        keep = partial_tag_suffix(self.buffer, THINK_END)  # a closing tag may be coming, after newlines
        before = self.buffer[: len(self.buffer) - keep]
        keep += len(before) - len(before.rstrip("\n"))
        if not self.started:  # an opening tag may still be coming
            keep = max(keep, partial_tag_suffix(self.buffer.lstrip("\n"), THINK_START))
        done, self.buffer = self.buffer[: len(self.buffer) - keep], self.buffer[len(self.buffer) - keep :]
        return self._reasoning(done, final=False)

    def finish(self) -> list[Part]:
        """Parts for what is still held back, at the end of the text."""
        if not self.in_thinking:
            return []
        rest, self.buffer = self.buffer, ""
        return self._reasoning(rest, final=True)

    def _reasoning(self, text: str, *, final: bool) -> list[Part]:
        if not self.started:
            text = text.lstrip("\n")
            if text.startswith(THINK_START):
                text = text[len(THINK_START) :].lstrip("\n")
            if not text and not final:
                return []
            self.started = bool(text)
        if final:
            text = text.rstrip("\n")
        return [("reasoning", text)] if text else []

    def _content(self, text: str) -> list[Part]:
        if not self.content_started:
            text = text.lstrip("\n")
            self.content_started = bool(text)
        return [("content", text)] if text else []


def split_reasoning(text: str, in_thinking: bool) -> tuple[str, str]:
    """(reasoning, content) of a whole generated text: the same as streaming it through `ReasoningStream`."""
    stream = ReasoningStream(in_thinking)
    parts = stream.feed(text) + stream.finish()
    return ("".join(t for kind, t in parts if kind == "reasoning"),
            "".join(t for kind, t in parts if kind == "content"))  # fmt: skip
