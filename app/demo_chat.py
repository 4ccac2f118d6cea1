"""The demo's model call: Gradio chat history in, streamed chat history out, through `mm.Pipeline` only.

History messages are Gradio 6 message dicts. The assistant's thinking is its own message with
`metadata={"title": THINKING_TITLE, ...}` (Gradio shows it as a collapsible block); an error is an
assistant message titled ERROR_TITLE. Neither goes back to the model: the chat template drops past
thinking anyway, and a turn that failed (e.g. a corrupt upload) is left out of later prompts.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from lm import SamplingParams
from mm import Pipeline, split_thinking

from .media import media_kind

THINKING_TITLE = "Thinking"
ERROR_TITLE = "Error"
MODEL_DEFAULT = "model default"  # the preset choice that means the checkpoint's generation_config.json
UNFINISHED_LOG = "unfinished: the reply ended before the model closed its thinking, so there is no answer"
STOPPED_LOG = "stopped"
# where mm.chat says a problem sits: "conversation 0, message 2, part 1: "
_WHERE = re.compile(r"^conversation \d+(?:, message (\d+), part (\d+))?: ")
log = logging.getLogger(__name__)

Message = dict[str, Any]


def user_message(text: str, files: list[str]) -> Message:
    """The history entry of a user turn: its files, then its text."""
    content: list[Any] = [{"path": path} for path in files]
    if text:
        content.append(text)
    return {"role": "user", "content": content}


def to_conversation(history: list[Message], *, fps: float | None, max_frames: int | None) -> list[Message]:
    """`mm.Pipeline` conversation from the chat history (thinking and failed turns left out)."""
    conversation: list[Message] = []
    for message in history:
        title = (message.get("metadata") or {}).get("title")
        if title == ERROR_TITLE:
            while conversation and conversation[-1]["role"] == "user":
                conversation.pop()  # the turn that failed
        elif not title:
            parts = [_part(item, fps, max_frames) for item in _contents(message)]
            conversation.append({"role": message["role"], "content": parts})
    if not conversation or conversation[-1]["role"] != "user":
        raise ValueError("the chat has no question to answer")
    return conversation


def _contents(message: Message) -> list[Any]:
    content = message.get("content")
    return content if isinstance(content, list) else [content]


def _part(item: Any, fps: float | None, max_frames: int | None) -> Message:
    """A Pipeline content part from a history item: a string, {"path"}, or Gradio's {"type", ...}."""
    if isinstance(item, str):
        return {"type": "text", "text": item}
    if item.get("type") == "text":
        return {"type": "text", "text": item["text"]}
    path = item["file"]["path"] if item.get("type") == "file" else item.get("path")
    if path is None:
        raise ValueError(f"unsupported chat content: {item!r}")
    if media_kind(path) == "image":
        return {"type": "image", "image": path}
    options = {key: value for key, value in (("fps", fps), ("max_frames", max_frames)) if value is not None}
    return {"type": "video", "video": path, **options}


def answer_messages(text: str, thinking: bool, seconds: float, finished: bool) -> list[Message]:
    """Assistant messages for the generated text so far: a thinking block (thinking mode), then the answer."""
    thought, answer = split_thinking(text, in_thinking=thinking)
    messages: list[Message] = []
    if thinking:
        metadata: dict[str, Any] = {"title": THINKING_TITLE, "duration": round(seconds, 1)}
        if "</think>" in text:
            metadata["status"] = "done"  # shown collapsed, the answer below it
        elif not finished:
            metadata["status"] = "pending"  # open, with a spinner
        else:
            metadata["log"] = UNFINISHED_LOG  # no status: shown open, since it is all there is
        messages.append({"role": "assistant", "content": thought, "metadata": metadata})
    if answer or not thinking:
        messages.append({"role": "assistant", "content": answer})
    return messages


def stopped_reply(history: list[Message] | None) -> list[Message]:
    """The chat when Stop cancels a reply: a thinking block still pending (its spinner would turn
    forever, as no update follows a cancelled reply) is marked stopped and shown open."""
    out = []
    for message in history or []:
        metadata = message.get("metadata") or {}
        if metadata.get("status") == "pending":
            metadata = {key: value for key, value in metadata.items() if key != "status"}
            message = {**message, "metadata": {**metadata, "log": STOPPED_LOG}}
        out.append(message)
    return out


def error_message(error: Exception, conversation: list[Message] | None = None) -> Message:
    """The chat's error message for `error`, raised on `conversation` (see `describe_error`)."""
    content = describe_error(error, conversation or [])
    return {"role": "assistant", "content": content, "metadata": {"title": ERROR_TITLE}}


def describe_error(error: Exception, conversation: list[Message]) -> str:
    """The cause, with uploads named by their own file names: not by their place in the conversation
    ("conversation 0, message 1, part 0") nor by their path in Gradio's upload folder. Bad input
    (ValueError) reads as the cause alone; anything else keeps its exception type."""
    text = str(error)
    named = None
    where = _WHERE.match(text)
    if where:
        text = text[where.end() :]
        if where.group(1) is not None:
            named = _upload_name(conversation, int(where.group(1)), int(where.group(2)))
    uploads = {source for message in conversation for source in _sources(message)}
    for path in sorted(uploads, key=len, reverse=True):  # a longer path first: one may contain another
        text = text.replace(path, Path(path).name)
    if named and named not in text:
        text = f"{named}: {text}"
    return text if isinstance(error, ValueError) else f"{type(error).__name__}: {text}"


def _sources(message: Message) -> list[str]:
    parts = message["content"] if isinstance(message.get("content"), list) else []
    return [p.get("image") or p.get("video") for p in parts if isinstance(p.get("image") or p.get("video"), str)]


def _upload_name(conversation: list[Message], message: int, part: int) -> str | None:
    try:
        source = conversation[message]["content"][part]
    except (IndexError, KeyError, TypeError):
        return None
    path = source.get("image") or source.get("video") if isinstance(source, dict) else None
    return Path(path).name if isinstance(path, str) else None


def stream_reply(pipeline: Pipeline, history: list[Message], params: SamplingParams, *, thinking: bool,
                 fps: float | None, max_frames: int | None) -> Iterator[list[Message]]:  # fmt: skip
    """The history with the assistant's reply growing, once per streamed piece; an error ends the reply
    as an error message instead of raising.

    `thinking` is passed to the chat template as enable_thinking; Qwen3.5 / Qwen3.6 templates then
    open a `<think>` block in the prompt, so the text before `</think>` is the thinking."""
    start, text, conversation = time.perf_counter(), "", None
    try:
        conversation = to_conversation(history, fps=fps, max_frames=max_frames)
        for piece in pipeline.stream(conversation, params, enable_thinking=thinking):
            text += piece
            yield history + answer_messages(text, thinking, time.perf_counter() - start, finished=False)
    except Exception as error:  # shown in the chat; the demo keeps serving
        if not isinstance(error, ValueError):  # ValueError: bad input (file, prompt length, options)
            log.exception("generation failed")
        partial = answer_messages(text, thinking, time.perf_counter() - start, finished=True) if text else []
        yield history + partial + [error_message(error, conversation)]
        return
    yield history + answer_messages(text, thinking, time.perf_counter() - start, finished=True)


def sampling_params(pipeline: Pipeline, preset: str, temperature: float, top_p: float, top_k: float,
                    max_new_tokens: float, presence_penalty: float, seed: float | None,
                    thinking_budget: float | None = None) -> SamplingParams:  # fmt: skip
    """SamplingParams from the demo's controls; a negative or empty seed means unseeded, a negative or
    empty thinking budget no limit."""
    return pipeline.default_params(
        None if preset == MODEL_DEFAULT else preset, temperature=float(temperature), top_p=float(top_p),
        top_k=int(top_k), max_new_tokens=int(max_new_tokens), presence_penalty=float(presence_penalty),
        seed=None if seed is None or seed < 0 else int(seed),
        thinking_budget=None if thinking_budget is None or thinking_budget < 0 else int(thinking_budget),
    )  # fmt: skip
