"""The OpenAI chat-completions request, validated (pydantic, strict types, unknown fields refused),
and the error shape `{"error": {"message", "type", "param", "code"}}`."""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from lm.sampling import INT_MAX, SEED_MAX, SEED_MIN


class APIError(Exception):
    """A request that cannot be served; becomes an OpenAI error response with `status`."""

    TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
             413: "invalid_request_error", 503: "service_unavailable", 500: "internal_server_error"}  # fmt: skip

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict[str, Any]:
        """The JSON body of the error response."""
        kind = self.TYPES.get(self.status, "invalid_request_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    """A 400: the client's mistake."""
    return APIError(400, message, param=param, code=code)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ImageURL(_Strict):
    url: str
    detail: Literal["auto", "low", "high"] | None = None


class ImagePart(_Strict):
    type: Literal["image_url"]
    image_url: ImageURL


class VideoURL(_Strict):
    url: str


class VideoPart(_Strict):
    type: Literal["video_url"]
    video_url: VideoURL


UserPart = Annotated[Union[TextPart, ImagePart, VideoPart], Field(discriminator="type")]


class FunctionCall(_Strict):
    name: str
    arguments: str  # a JSON object, as text


class ToolCallItem(_Strict):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class SystemMessage(_Strict):
    role: Literal["system", "developer"]
    content: str | list[TextPart]
    name: str | None = None


class UserMessage(_Strict):
    role: Literal["user"]
    content: str | list[UserPart]
    name: str | None = None


class AssistantMessage(_Strict):
    role: Literal["assistant"]
    content: str | list[TextPart] | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None  # vLLM's newer name for reasoning_content
    tool_calls: list[ToolCallItem] | None = None
    name: str | None = None
    refusal: str | None = None
    # What the openai client's `message.model_dump()` adds, so a reply can be sent back as history:
    annotations: list[Any] | None = None
    audio: None = None
    function_call: None = None


class ToolMessage(_Strict):
    role: Literal["tool"]
    content: str | list[TextPart]
    tool_call_id: str


Message = Annotated[Union[SystemMessage, UserMessage, AssistantMessage, ToolMessage], Field(discriminator="role")]


class FunctionDef(_Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_.\-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class StreamOptions(_Strict):
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None


class VideoKwargs(_Strict):
    """vLLM-style `mm_processor_kwargs`: how to sample the request's videos."""

    fps: float | None = Field(default=None, gt=0)
    num_frames: int | None = Field(default=None, ge=2, le=INT_MAX)
    min_frames: int | None = Field(default=None, ge=2, le=INT_MAX)
    max_frames: int | None = Field(default=None, ge=2, le=INT_MAX)


class JSONSchemaFormat(_Strict):
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    """"text"; "json_object" (any JSON object); "json_schema" (`json_schema.schema`): the answer
    is compact JSON that validates (mm/constraints.py)."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class ChatCompletionRequest(_Strict):
    """POST /v1/chat/completions. Unknown fields are refused; see the README for what each does."""

    model: str
    messages: list[Message] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1, le=INT_MAX)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=INT_MAX)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=-1, le=INT_MAX)
    min_p: float | None = Field(default=None, ge=0, le=1)
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    repetition_penalty: float | None = Field(default=None, gt=0)
    seed: int | None = Field(default=None, ge=SEED_MIN, le=SEED_MAX)
    stop: str | list[str] | None = None
    n: int | None = Field(default=None, ge=1, le=INT_MAX)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    mm_processor_kwargs: VideoKwargs | None = None
    include_reasoning: bool | None = True
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    logit_bias: dict[str, float] | None = None
    response_format: ResponseFormat | None = None
    thinking_budget: int | None = Field(default=None, ge=0, le=INT_MAX)
    user: str | None = None


def parse_request(body: bytes) -> ChatCompletionRequest:
    """The validated request; `APIError` 400 naming the first offending field otherwise."""
    try:
        return ChatCompletionRequest.model_validate_json(body)
    except ValidationError as error:
        raise bad_request(*_describe(error)) from None


def _describe(error: ValidationError) -> tuple[str, str | None]:
    """(message, param) for the most specific problem pydantic found, e.g.
    ("messages.0.content.1.image_url.url: Field required", "messages")."""
    problems = [(_clean(item["loc"]), item) for item in error.errors(include_url=False)]
    path, first = max(problems, key=lambda p: len(p[0]))
    where = ".".join(path)
    if first["type"] == "json_invalid":
        return f"the request body is not valid JSON: {first['msg']}", None
    if first["type"] in ("model_type", "model_attributes_type") and not path:
        return "the request body must be a JSON object", None
    if first["type"] == "too_short" and path == ["messages"]:
        return "messages must be a non-empty list of messages", "messages"
    if first["type"] == "extra_forbidden":
        return f"unknown field {where!r} (not part of the chat completions API served here)", where
    messages = dict.fromkeys(item["msg"] for p, item in problems if p == path)  # a union: each member's reason
    return f"{where or 'body'}: {'; or '.join(messages)}", (path[0] if path else None)


_TAGS = {"system", "developer", "user", "assistant", "tool", "text", "image_url", "video_url"}


def _clean(loc: tuple[Any, ...]) -> list[str]:
    """The field path of an error location without pydantic's union-member labels."""
    path: list[str] = []
    for i, part in enumerate(loc):
        text = str(part)
        if text in ("str", "NamedToolChoice") or text.startswith(("list[", "literal[", "function-", "json-")):
            continue
        if text in _TAGS and i > 0 and isinstance(loc[i - 1], int):  # the discriminator value of a union member
            continue
        path.append(text)
    return path
