"""Chat messages: collect the images and videos of a conversation, render it with the chat template.

A conversation is a list of `{"role", "content"}` messages; content is a string or a list of parts:
`{"type": "text", "text": ...}`, `{"type": "image", "image": <path|URL|bytes|PIL|array>}` (also
`{"type": "image_url", "image_url": <url> | {"url": <url>}}`; option "max_pixels", the pixel budget of
an encoded image: preprocess.load_image) and `{"type": "video", "video": <path | bytes | list of frames
| [T, H, W, 3] array | VideoClip>, ...options}` (preprocess.sample_video's, "max_pixels" included). The
template only sees the part types; the media are collected, in the order the template renders their
placeholders.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jinja2

CHAT_TEMPLATE_FILE = "chat_template.jinja"
DEFAULT_CHAT_TEMPLATE_PATH = Path(__file__).resolve().parent / CHAT_TEMPLATE_FILE
"""The official Qwen3.5 chat template, as shipped in the checkpoints' chat_template.jinja."""
VIDEO_OPTIONS = ("fps", "num_frames", "min_frames", "max_frames", "start", "end", "max_pixels")
IMAGE_OPTIONS = ("max_pixels",)
_PART_TYPES = ("text", "image", "image_url", "video")

Message = dict[str, Any]
Conversation = list[Message]


@dataclass(frozen=True)
class MediaItem:
    """One image or video of a conversation: its source, options and where it was found."""

    kind: str  # "image" or "video"
    source: Any
    where: str  # e.g. "conversation 0, message 1, part 2", for error messages
    options: dict[str, Any] = field(default_factory=dict)


def load_chat_template(path: str | Path) -> str:
    """The chat template of a checkpoint: chat_template.jinja, else tokenizer_config.json's "chat_template"."""
    path = Path(path)
    if (path / CHAT_TEMPLATE_FILE).is_file():
        return (path / CHAT_TEMPLATE_FILE).read_text(encoding="utf-8")
    config_file = path / "tokenizer_config.json"
    config = json.loads(config_file.read_text(encoding="utf-8")) if config_file.is_file() else {}
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        template = {item["name"]: item["template"] for item in template}.get("default")
    if not isinstance(template, str):
        raise FileNotFoundError(f"no chat template in {path}: neither {CHAT_TEMPLATE_FILE} nor a tokenizer_config.json "
                                "'chat_template' string")  # fmt: skip
    return template


def collect_media(conversation: Conversation, index: int) -> tuple[Conversation, list[MediaItem]]:
    """Split a conversation into template-ready messages (media parts reduced to their type) and its media."""
    if not isinstance(conversation, list) or not conversation:
        raise ValueError(f"conversation {index} must be a non-empty list of messages, "
                         f"got {type(conversation).__name__}")  # fmt: skip
    messages: Conversation = []
    media: list[MediaItem] = []
    for m, message in enumerate(conversation):
        if not isinstance(message, dict) or "role" not in message:
            raise ValueError(f"conversation {index}, message {m}: expected a dict with 'role' and 'content'")
        content = message.get("content")
        if isinstance(content, list):
            parts = [_template_part(part, f"conversation {index}, message {m}, part {p}", media)
                     for p, part in enumerate(content)]  # fmt: skip
            message = {**message, "content": parts}
        elif content is not None and not isinstance(content, str):
            raise ValueError(f"conversation {index}, message {m}: content must be a string or a list of parts, "
                             f"got {type(content).__name__}")  # fmt: skip
        messages.append(message)
    return messages, media


def _template_part(part: Any, where: str, media: list[MediaItem]) -> dict[str, Any]:
    if not isinstance(part, dict):
        raise ValueError(f"{where}: a content part must be a dict, got {type(part).__name__}")
    kind = part.get("type") or next((key for key in _PART_TYPES if key in part), None)
    if kind == "text":
        if not isinstance(part.get("text"), str):
            raise ValueError(f"{where}: a text part needs a string 'text'")
        return {"type": "text", "text": part["text"]}
    if kind in ("image", "image_url"):
        options = {key: part[key] for key in IMAGE_OPTIONS if part.get(key) is not None}
        media.append(MediaItem("image", _image_source(part, where), where, options))
        return {"type": "image"}
    if kind == "video":
        if part.get("video") is None:
            raise ValueError(f"{where}: a video part needs 'video' (a path, bytes, frames or a VideoClip)")
        options = {key: part[key] for key in VIDEO_OPTIONS if part.get(key) is not None}
        media.append(MediaItem("video", part["video"], where, options))
        return {"type": "video"}
    raise ValueError(f"{where}: unknown content part type {kind!r}; expected one of {', '.join(_PART_TYPES)}")


def _image_source(part: dict[str, Any], where: str) -> Any:
    source = part.get("image")
    if source is None:
        source = part.get("image_url")
        if isinstance(source, dict):
            source = source.get("url")
    if source is None:
        raise ValueError(f"{where}: an image part needs 'image' (path, URL, bytes, PIL image or array) "
                         "or 'image_url' (a URL or {'url': ...})")  # fmt: skip
    return source


def render(tokenizer: Any, template: str, messages: Conversation, index: int, *, add_generation_prompt: bool,
           enable_thinking: bool | None, template_kwargs: dict[str, Any] | None = None) -> str:  # fmt: skip
    """The prompt text of one conversation, rendered by transformers' chat template machinery.

    template_kwargs: more variables for the template (e.g. `tools`, Qwen3.6's `preserve_thinking`)."""
    kwargs = dict(template_kwargs or {})
    if enable_thinking is not None:
        kwargs["enable_thinking"] = enable_thinking
    try:
        text = tokenizer.apply_chat_template(
            messages, chat_template=template, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
        )
    except jinja2.TemplateError as error:
        raise ValueError(f"conversation {index}: the chat template refused it: {error}") from error
    if not isinstance(text, str):
        raise TypeError(f"conversation {index}: chat template rendered {type(text).__name__}, expected str")
    return text


def split_thinking(text: str, *, in_thinking: bool = False) -> tuple[str, str]:
    """Split generated text into (thinking, answer) at the first `</think>`, as the chat template does.

    The thinking is the text before `</think>` (after an optional `<think>`), without surrounding newlines;
    the answer is the text after the last `</think>`, without leading newlines. Text with no `</think>` is
    all answer, unless `in_thinking` says the prompt left a `<think>` block open (thinking mode): then it
    is all thinking (generation stopped before the model closed the block).
    """
    if "</think>" not in text:
        return (text.strip("\n"), "") if in_thinking else ("", text)
    thinking = text.split("</think>")[0].rstrip("\n").split("<think>")[-1].lstrip("\n")
    answer = text.split("</think>")[-1].lstrip("\n")
    return thinking, answer
