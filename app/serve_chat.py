"""A validated chat-completions request to what the model runs: the conversation (media as bytes),
sampling parameters, chat template variables (tools, thinking) and the request limits."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from lm import SamplingParams

from .openai_protocol import ChatCompletionRequest, NamedToolChoice, ResponseFormat, bad_request
from .serve_media import MediaPolicy

RESERVED_TEMPLATE_KWARGS = frozenset({"messages", "tools", "add_generation_prompt", "chat_template"})
REQUIRED_TOOL_NOTE = "You must answer by calling one or more of the functions above."
NAMED_TOOL_NOTE = "You must answer by calling the function {name}."


@dataclass(frozen=True)
class Limits:
    """What one request may ask for (each over-limit request gets a 400 naming the limit)."""

    max_request_bytes: int = 64 << 20
    max_images: int = 16  # images per request
    max_videos: int = 4  # videos per request
    max_video_frames: int = 768  # frames per video (also the default sampling cap)
    default_max_tokens: int = 4096  # when a request gives no max_tokens (at most half the context)
    media: MediaPolicy = field(default_factory=MediaPolicy)


@dataclass(frozen=True)
class MediaRef:
    """One image or video of a request: where it is (`messages[m].content[p]`) and its URL."""

    where: str
    kind: str  # "image" or "video"
    url: str


@dataclass
class ChatJob:
    """One request, ready to generate. `tools` are the functions whose calls are parsed ([]: none)."""

    conversation: list[dict[str, Any]]
    params: SamplingParams
    enable_thinking: bool | None
    template_kwargs: dict[str, Any]
    tools: list[dict[str, Any]]
    include_reasoning: bool
    added_messages: int = 0  # messages put before the request's own (the tool_choice note's system turn)
    rule: Any = None  # a constraint on each next token (app/tool_choice.py for tool_choice required / named)
    answer_rule: Any = None  # `rule` with the structured output and thinking budget, made (so checked) at admission

    def where(self, message: str) -> str:
        """A processor error's "conversation 0, message M, part P" as the request's "messages[m].content[P]"."""
        def name(match: re.Match) -> str:
            index = int(match.group(1)) - self.added_messages
            return f"messages[{index}]" + (f".content[{match.group(2)}]" if match.group(2) else "")

        return _PROCESSOR_WHERE.sub(name, message)


_PROCESSOR_WHERE = re.compile(r"conversation 0, message (\d+)(?:, part (\d+))?")


def sampling_params(request: ChatCompletionRequest, defaults: SamplingParams, max_context: int,
                    limits: Limits) -> SamplingParams:  # fmt: skip
    """The request's sampling parameters over the checkpoint's defaults (generation_config.json)."""
    if request.top_logprobs is not None and not request.logprobs:
        raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
    if request.stream_options is not None and not request.stream:
        raise bad_request("stream_options is only allowed with stream: true", "stream_options")
    max_tokens = request.max_completion_tokens or request.max_tokens
    if max_tokens is None:
        max_tokens = min(limits.default_max_tokens, max_context // 2)
    elif max_tokens >= max_context:
        raise bad_request(f"max_tokens={max_tokens} does not fit the context of {max_context} tokens "
                          "(--max-model-len); ask for fewer", "max_tokens", "context_length_exceeded")  # fmt: skip
    values = dict(max_new_tokens=max_tokens, temperature=request.temperature, top_p=request.top_p,
                  top_k=None if request.top_k is None else max(request.top_k, 0), min_p=request.min_p,
                  presence_penalty=request.presence_penalty, frequency_penalty=request.frequency_penalty,
                  repetition_penalty=request.repetition_penalty,
                  seed=request.seed,
                  stop=[request.stop] if isinstance(request.stop, str) else request.stop)  # fmt: skip
    if any(not s for s in values["stop"] or []):
        raise bad_request("stop strings must not be empty", "stop")
    values["json_schema"] = response_schema(request.response_format)
    values["thinking_budget"] = request.thinking_budget
    values["logprobs"] = (request.top_logprobs or 0) if request.logprobs else None
    values["logit_bias"] = logit_bias(request.logit_bias)
    chosen = {key: value for key, value in values.items() if value is not None}
    merged = {f: getattr(defaults, f) for f in defaults.__dataclass_fields__} | chosen
    try:
        return SamplingParams(**merged)
    except ValueError as error:
        raise bad_request(str(error)) from None


def logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    """{token id: bias} from the request's {"id": bias} (ids checked against the vocabulary later)."""
    if not bias:
        return None
    if not all(key.isdigit() for key in bias):
        raise bad_request(f"logit_bias keys must be token ids, got {next(k for k in bias if not k.isdigit())!r}",
                          "logit_bias")  # fmt: skip
    return {int(key): value for key, value in bias.items()}


def response_schema(response_format: ResponseFormat | None) -> dict[str, Any] | None:
    """The JSON schema the answer must follow: None for text, any object for "json_object"."""
    if response_format is None or response_format.type == "text":
        if response_format is not None and response_format.json_schema is not None:
            raise bad_request("response_format.json_schema is only for type json_schema", "response_format")
        return None
    if response_format.type == "json_object":
        return {"type": "object"}
    if response_format.json_schema is None or response_format.json_schema.schema_ is None:
        raise bad_request("response_format of type json_schema needs json_schema.schema", "response_format")
    return response_format.json_schema.schema_


def template_inputs(request: ChatCompletionRequest) -> tuple[bool | None, dict[str, Any], list[dict[str, Any]]]:
    """(enable_thinking, more template variables, tools whose calls to parse) from `chat_template_kwargs`,
    `tools` and `tool_choice`."""
    kwargs = dict(request.chat_template_kwargs or {})
    clash = sorted(RESERVED_TEMPLATE_KWARGS & set(kwargs))
    if clash:
        raise bad_request(f"chat_template_kwargs may not set {clash} (use the request's own fields)",
                          "chat_template_kwargs")  # fmt: skip
    thinking = kwargs.pop("enable_thinking", None)
    if thinking is not None and not isinstance(thinking, bool):
        raise bad_request("chat_template_kwargs.enable_thinking must be true or false", "chat_template_kwargs")
    tools = [tool.model_dump(exclude_none=True) for tool in request.tools or []]
    names = [tool["function"]["name"] for tool in tools]
    if len(set(names)) != len(names):
        raise bad_request("tools: two tools have the same function name", "tools")
    choice = request.tool_choice or ("auto" if tools else "none")
    if choice in ("required",) or isinstance(choice, NamedToolChoice):
        if not tools:
            raise bad_request("tool_choice requires tools", "tool_choice")
    if isinstance(choice, NamedToolChoice):
        if choice.function.name not in names:
            raise bad_request(f"tool_choice names {choice.function.name!r}, which is not among the tools",
                              "tool_choice")  # fmt: skip
        tools = [tool for tool in tools if tool["function"]["name"] == choice.function.name]
    if choice == "none":
        tools = []
    if tools:
        kwargs["tools"] = tools
    return thinking, kwargs, tools


def media_refs(request: ChatCompletionRequest, limits: Limits) -> list[MediaRef]:
    """The request's images and videos in order; a 400 naming the limit when there are too many."""
    refs, counts = [], {"image": 0, "video": 0}
    for index, message in enumerate(request.messages):
        if message.role != "user" or isinstance(message.content, str):
            continue
        for j, part in enumerate(message.content):
            if part.type == "text":
                continue
            kind = "image" if part.type == "image_url" else "video"
            counts[kind] += 1
            limit = limits.max_images if kind == "image" else limits.max_videos
            if counts[kind] > limit:
                flag = "--max-images" if kind == "image" else "--max-videos"
                raise bad_request(f"more than {limit} {kind}s in the request: the limit is {limit} {kind}s per "
                                  f"request ({flag})", "messages", f"too_many_{kind}s")  # fmt: skip
            url = part.image_url.url if kind == "image" else part.video_url.url
            refs.append(MediaRef(f"messages[{index}].content[{j}]", kind, url))
    return refs


def build_conversation(request: ChatCompletionRequest, limits: Limits, note: str | None,
                       media: Mapping[str, bytes]) -> list[dict[str, Any]]:  # fmt: skip
    """The messages as `mm.Pipeline` takes them, with the bytes `media` holds for each `MediaRef.where`;
    `note` appended to the system turn."""
    video = _video_options(request, limits)
    conversation = [_message(m, i, limits, media, video) for i, m in enumerate(request.messages)]
    if note:
        if conversation[0]["role"] == "system":
            conversation[0]["content"] = f"{_text(conversation[0]['content'])}\n\n{note}".strip()
        else:
            conversation.insert(0, {"role": "system", "content": note})
    return conversation


def tool_note(request: ChatCompletionRequest) -> str | None:
    """What the system turn says for tool_choice "required" or a named function (decoding also
    enforces it: app/tool_choice.py)."""
    if request.tool_choice == "required":
        return REQUIRED_TOOL_NOTE
    if isinstance(request.tool_choice, NamedToolChoice):
        return NAMED_TOOL_NOTE.format(name=request.tool_choice.function.name)
    return None


def _video_options(request: ChatCompletionRequest, limits: Limits) -> dict[str, Any]:
    options = request.mm_processor_kwargs.model_dump(exclude_none=True) if request.mm_processor_kwargs else {}
    for key in ("num_frames", "max_frames", "min_frames"):
        if options.get(key, 0) > limits.max_video_frames:
            raise bad_request(f"mm_processor_kwargs.{key}={options[key]} is over the limit of "
                              f"{limits.max_video_frames} frames per video (--max-video-frames)",
                              "mm_processor_kwargs", "too_many_frames")  # fmt: skip
    options.setdefault("max_frames", limits.max_video_frames)
    options["max_pixels"] = limits.media.max_pixels
    return options


def _message(message: Any, index: int, limits: Limits, media: Mapping[str, bytes],
             video: dict[str, Any]) -> dict[str, Any]:  # fmt: skip
    where = f"messages[{index}]"
    if message.role in ("system", "developer"):
        return {"role": "system", "content": _text(message.content)}
    if message.role == "tool":
        return {"role": "tool", "content": _text(message.content)}
    if message.role == "assistant":
        out: dict[str, Any] = {"role": "assistant", "content": _text(message.content or "")}
        reasoning = message.reasoning_content if message.reasoning_content is not None else message.reasoning
        if reasoning is not None:
            out["reasoning_content"] = reasoning
        if message.tool_calls:
            out["tool_calls"] = [_history_call(c, f"{where}.tool_calls[{j}]") for j, c in enumerate(message.tool_calls)]
        return out
    if isinstance(message.content, str):
        return {"role": "user", "content": message.content}
    return {"role": "user", "content": [_part(p, f"{where}.content[{j}]", limits, media, video)
                                        for j, p in enumerate(message.content)]}  # fmt: skip


def _part(part: Any, where: str, limits: Limits, media: Mapping[str, bytes], video: dict[str, Any]) -> dict[str, Any]:
    if part.type == "text":
        return {"type": "text", "text": part.text}
    if part.type == "image_url":
        return {"type": "image", "image": media[where], "max_pixels": limits.media.max_pixels}
    return {"type": "video", "video": media[where], **video}


def _history_call(call: Any, where: str) -> dict[str, Any]:
    """An earlier assistant turn's tool call, with its arguments as the dict the chat template iterates."""
    try:
        arguments = json.loads(call.function.arguments or "{}")
    except json.JSONDecodeError as error:
        raise bad_request(f"{where}.function.arguments is not valid JSON: {error}", "messages") from None
    if not isinstance(arguments, dict):
        raise bad_request(f"{where}.function.arguments must be a JSON object", "messages")
    return {"type": "function", "function": {"name": call.function.name, "arguments": arguments}}


def _text(content: Any) -> str:
    """A text-only content: a string, or the concatenation of its text parts."""
    return content if isinstance(content, str) else "".join(part.text for part in content)
