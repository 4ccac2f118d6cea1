"""OpenAI-compatible HTTP server: `python -m app.serve [--model PATH] [--host 127.0.0.1] [--port 8000]`.

Endpoints: `POST /v1/chat/completions` (streamed as server-sent events or not; text, images,
videos, reasoning, tool calls), `GET /v1/models`, `GET /health`. The model runs through
`serve_backend.Backend` only; see the README for the parameters and the limits.
"""

from __future__ import annotations

import argparse
import asyncio
import hmac
import ipaddress
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from lm.serving import EngineClosedError
from mm.constraints import ConstraintError
from mm.processor import PromptTooLongError

from . import serve_choices as choices
from . import serve_response as shape
from .openai_protocol import APIError, ChatCompletionRequest, NamedToolChoice, bad_request, parse_request
from .loading import add_model_arguments, check_model, load_pipeline, pipeline_options
from .reasoning import prompt_opens_thinking
from .serve_backend import Backend, Generation, ServerBusy
from .tool_choice import ToolCallRule
from .serve_chat import ChatJob, Limits, MediaRef, build_conversation, media_refs, sampling_params, template_inputs
from .serve_chat import tool_note
from .serve_fetch import FetchPolicy
from .serve_media import MediaPolicy, media_bytes

log = logging.getLogger("app.serve")


@dataclass(frozen=True)
class ServeConfig:
    """What the server answers to: its model name(s), an optional API key, and the request limits."""

    model_name: str
    api_key: str | None = None
    limits: Limits = field(default_factory=Limits)


@dataclass
class _Record:
    """What the request's log line says."""

    rid: str
    start: float = field(default_factory=time.perf_counter)
    status: int = 200
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    first: float | None = None
    finish: str = "-"
    drafts: str = ""  # with speculative decoding: its acceptance and new tokens per verify step

    def line(self) -> str:
        ttft = "-" if self.first is None else f"{self.first - self.start:.3f}s"
        tokens = lambda n: "-" if n is None else str(n)  # noqa: E731
        return (f"{self.rid} status={self.status} prompt_tokens={tokens(self.prompt_tokens)} "
                f"completion_tokens={tokens(self.completion_tokens)} ttft={ttft} "
                f"total={time.perf_counter() - self.start:.3f}s finish={self.finish}{self.drafts}")  # fmt: skip


def create_app(backend: Backend, config: ServeConfig) -> FastAPI:
    """The FastAPI app serving `backend` under `config`."""
    app = FastAPI(title="qwen35-vl", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.backend, app.state.config = backend, config
    # media fetches run in their own bounded pool, never in the one that prepares requests
    fetch_pool = ThreadPoolExecutor(config.limits.media.fetch_workers, thread_name_prefix="media-fetch")

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, error: HTTPException) -> JSONResponse:
        message = f"{request.method} {request.url.path}: {error.detail}"
        return JSONResponse(APIError(error.status_code, message).body(), status_code=error.status_code)

    @app.get("/health")
    async def health() -> Response:
        if (error := backend.pipeline.engine_error) is not None:  # no request can be served any more
            body = {"status": "error", "error": f"the engine stopped: {type(error).__name__}: {error}"}
            return JSONResponse(body, status_code=503)
        return JSONResponse({"status": "ok", "running": backend.running, "waiting": backend.waiting})

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        try:
            _check_key(request, config.api_key)
        except APIError as error:
            return _error_response(error)
        card = {"id": config.model_name, "object": "model", "created": shape.now(), "owned_by": "qwen35-vl",
                "max_model_len": backend.max_context}  # fmt: skip
        return JSONResponse({"object": "list", "data": [card]})

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        record = _Record(f"chatcmpl-{uuid.uuid4().hex}")
        try:
            return await _chat(request, backend, config, record, fetch_pool)
        except ClientDisconnect:  # the client went away while sending its request: nobody to answer
            record.status, record.finish = 499, "cancelled"
            log.info(record.line())
            return Response(status_code=499)
        except Exception as error:  # noqa: BLE001 - every failure becomes an OpenAI error response
            api_error = _as_api_error(error)
            record.status, record.finish = api_error.status, "error"
            log.info("%s error=%r", record.line(), api_error.message)
            return _error_response(api_error)

    return app


async def _chat(request: Request, backend: Backend, config: ServeConfig, record: _Record,
                fetch_pool: ThreadPoolExecutor) -> Response:  # fmt: skip
    _check_key(request, config.api_key)
    body = await _read_body(request, config.limits.max_request_bytes)
    chat = parse_request(body)
    if chat.model != config.model_name:
        raise APIError(404, f"the model {chat.model!r} does not exist: this server serves {config.model_name!r}",
                       param="model", code="model_not_found")  # fmt: skip
    if chat.stream_options is not None and chat.stream_options.continuous_usage_stats:
        raise bad_request("stream_options.continuous_usage_stats is not supported", "stream_options")
    refs = media_refs(chat, config.limits)
    media = await _fetch_media(refs, backend, config.limits.media, fetch_pool) if refs else {}
    job, in_thinking = await asyncio.to_thread(_prepare, chat, backend, config.limits, media)
    answer = shape.AnswerStream(in_thinking=in_thinking, tools=job.tools, include_reasoning=job.include_reasoning)
    generation = backend.start(job)
    watcher = asyncio.create_task(_watch_disconnect(request, generation))
    events = generation.events()
    try:
        first = await anext(events, None)  # errors before the first piece still get their status code
    except ValueError as error:  # the processor refused an input (an image that is not one, ...)
        watcher.cancel()
        if isinstance(error, PromptTooLongError):
            raise PromptTooLongError(job.where(str(error))) from None
        raise bad_request(job.where(str(error)), "messages") from None
    except BaseException:
        watcher.cancel()
        generation.cancel()
        raise
    if first is None:  # cancelled while waiting: the client is gone
        watcher.cancel()
        record.status, record.finish = 499, "cancelled"
        log.info(record.line())
        return Response(status_code=204)
    record.first = time.perf_counter()
    if (chat.n or 1) > 1:  # choice 0's prompt is prefilled now: the others resume from it
        watcher.cancel()
        group = choices.Choices(backend, job, generation, events, first, chat.n, in_thinking)
        return await _many(chat, config.model_name, record, backend, group, request)
    if chat.stream:
        stream = _sse(chat, config.model_name, record, generation, events, first, answer, watcher)
        return StreamingResponse(stream, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    try:
        return JSONResponse(await _complete(config.model_name, record, events, first, answer, backend.token_text))
    finally:
        watcher.cancel()
        generation.cancel()


async def _many(chat: ChatCompletionRequest, model: str, record: _Record, backend: Backend,
                group: choices.Choices, request: Request) -> Response:  # fmt: skip
    """The response of `n` > 1 choices (app/serve_choices.py), streamed or not."""
    watcher = asyncio.create_task(_watch_disconnect(request, group))

    def done(outputs: list[Any]) -> None:
        usage = choices.total_usage(outputs)
        record.prompt_tokens, record.completion_tokens = usage["prompt_tokens"], usage["completion_tokens"]
        record.finish = ",".join(shape.finish_reason(o, s.calls) for o, s in zip(outputs, group.streams))

    if chat.stream:
        async def sse() -> AsyncIterator[str]:
            try:
                async for event in choices.stream(chat, model, record.rid, group, backend.token_text, done):
                    yield event
            except Exception as error:  # noqa: BLE001 - after the headers, an error can only be an event
                api_error = _as_api_error(error)
                record.status, record.finish = api_error.status, "error"
                yield _event(api_error.body())
                yield "data: [DONE]\n\n"
            finally:
                watcher.cancel()
                group.cancel()
                log.info(record.line())

        return StreamingResponse(sse(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    try:
        body, outputs = await choices.complete(model, record.rid, group, backend.token_text)
    finally:
        watcher.cancel()
        group.cancel()
    if body is None:  # cancelled: the client is gone
        record.status, record.finish = 499, "cancelled"
        log.info(record.line())
        return Response(status_code=204)
    done(outputs)
    log.info(record.line())
    return JSONResponse(body)


async def _fetch_media(refs: list[MediaRef], backend: Backend, policy: MediaPolicy,
                       pool: ThreadPoolExecutor) -> dict[str, bytes]:  # fmt: skip
    """The bytes of each of `refs`, fetched at once in `pool`; meanwhile the request counts as waiting."""
    loop = asyncio.get_running_loop()
    with backend.waiting_turn():
        futures = [loop.run_in_executor(pool, media_bytes, ref.url, policy, ref.where) for ref in refs]
        try:
            data = await asyncio.gather(*futures)
        except BaseException:
            for future in futures:  # those not started yet never start
                future.cancel()
            raise
    return {ref.where: item for ref, item in zip(refs, data)}


def _prepare(chat: ChatCompletionRequest, backend: Backend, limits: Limits,
             media: dict[str, bytes]) -> tuple[ChatJob, bool]:  # fmt: skip
    """The job of a request (run in a thread) and whether its prompt opens thinking."""
    params = sampling_params(chat, backend.default_params(), backend.max_context, limits)
    if (chat.n or 1) > backend.pipeline.engine.max_batch:
        raise bad_request(f"n={chat.n} is more choices than the engine's slots ({backend.pipeline.engine.max_batch}, "
                          "--max-batch)", "n")  # fmt: skip
    if (chat.n or 1) > 1 and (chat.tool_choice == "required" or isinstance(chat.tool_choice, NamedToolChoice)):
        raise bad_request("n > 1 with tool_choice required or a named function is not supported", "n")
    vocab = backend.pipeline.model.config.text.vocab_size
    unknown = [token for token, _ in params.logit_bias if token >= vocab]
    if unknown:
        raise bad_request(f"logit_bias names token {unknown[0]}, beyond the vocabulary of {vocab}", "logit_bias")
    thinking, kwargs, tools = template_inputs(chat)
    conversation = build_conversation(chat, limits, tool_note(chat), media)
    job = ChatJob(conversation, params, thinking, kwargs, tools, include_reasoning=chat.include_reasoning is not False,
                  added_messages=len(conversation) - len(chat.messages))  # fmt: skip
    try:
        prompt = backend.render_prompt(conversation, thinking, kwargs)
    except ValueError as error:
        raise bad_request(job.where(str(error)), "messages") from None
    in_thinking = prompt_opens_thinking(prompt)
    if tools and (chat.tool_choice == "required" or isinstance(chat.tool_choice, NamedToolChoice)):
        try:
            job.rule = ToolCallRule(backend.pipeline.processor.tokenizer, tools, backend.pipeline.model.eos_token_ids(),
                                    in_thinking=in_thinking, max_tokens=params.max_new_tokens,
                                    grammars=backend.pipeline.grammars)  # fmt: skip
        except ConstraintError as error:
            raise bad_request(f"tools: a parameter's schema: {error}", "tools") from None
    try:  # the constraint is made now, so that a bad one is a 400 naming its field; this rule then runs
        job.answer_rule = backend.pipeline.constraint_rule(params, in_thinking, job.rule)
    except ConstraintError as error:
        raise bad_request(str(error), error.param or "response_format") from None
    return job, in_thinking


async def _complete(model: str, record: _Record, events: AsyncIterator[Any], first: Any,
                    answer: shape.AnswerStream, decode) -> dict[str, Any]:  # fmt: skip
    """The non-streamed response: all pieces, then the output."""
    deltas, item = [], first
    while isinstance(item, str):
        deltas += answer.feed(item)
        item = await anext(events, None)
    if item is None:  # cancelled: the client is gone
        record.status, record.finish = 499, "cancelled"
        log.info(record.line())
        return {}
    deltas += answer.finish()
    _finished(record, item, answer.calls)
    log.info(record.line())
    return shape.completion(record.rid, model, shape.now(), deltas, item, answer.calls, decode)


async def _sse(chat: ChatCompletionRequest, model: str, record: _Record, generation: Generation,
               events: AsyncIterator[Any], first: Any, answer: shape.AnswerStream,
               watcher: asyncio.Task) -> AsyncIterator[str]:  # fmt: skip
    """The streamed response: a role chunk, delta chunks, the finish chunk, usage, `[DONE]`."""
    created, rid = shape.now(), record.rid
    with_usage = bool(chat.stream_options and chat.stream_options.include_usage)

    cursor = shape.LogprobsCursor(generation.backend.token_text)

    def send(delta: dict[str, Any], finish: str | None = None) -> str:
        logprobs = None
        if chat.logprobs and generation.answer is not None and (delta or finish):
            logprobs = cursor.next(generation.answer.request)
        return _event(shape.chunk(rid, model, created, delta, finish, with_usage=with_usage, logprobs=logprobs))

    item, output = first, None
    try:
        yield send({"role": "assistant", "content": ""})
        while isinstance(item, str):
            for delta in answer.feed(item):
                yield send(delta)
            item = await anext(events, None)
        if item is None:
            record.status, record.finish = 499, "cancelled"
            return
        output = item
        for delta in answer.finish():
            yield send(delta)
        _finished(record, output, answer.calls)
        yield send({}, record.finish)
        if with_usage:
            yield _event(shape.chunk(rid, model, created, None, usage_=shape.usage(output), with_usage=True))
        yield "data: [DONE]\n\n"
    except Exception as error:  # noqa: BLE001 - after the headers, an error can only be an event
        api_error = _as_api_error(error)
        record.status, record.finish = api_error.status, "error"
        yield _event(api_error.body())
        yield "data: [DONE]\n\n"
    except BaseException:  # the client went away (the response task is cancelled)
        record.status, record.finish = 499, "cancelled"
        raise
    finally:
        watcher.cancel()
        generation.cancel()
        log.info(record.line())


def _finished(record: _Record, output: Any, calls: int) -> None:
    record.prompt_tokens, record.completion_tokens = output.prompt_tokens, output.completion_tokens
    record.finish = shape.finish_reason(output, calls)
    if "tokens_per_step" in output.timings:
        record.drafts = (f" draft_acceptance={output.timings['draft_acceptance']:.2f} "
                         f"tokens_per_step={output.timings['tokens_per_step']:.2f}")  # fmt: skip


_event = shape.event


async def _watch_disconnect(request: Request, generation: Generation) -> None:
    """Cancel the generation when the client disconnects."""
    while not await request.is_disconnected():
        await asyncio.sleep(0.2)
    generation.cancel()


async def _read_body(request: Request, limit: int) -> bytes:
    size = request.headers.get("content-length")
    if size is not None and size.isdigit() and int(size) > limit:
        raise _body_too_big(limit)
    chunks, total = [], 0
    async for chunk in request.stream():
        total += len(chunk)
        if total > limit:
            raise _body_too_big(limit)
        chunks.append(chunk)
    return b"".join(chunks)


def _body_too_big(limit: int) -> APIError:
    return bad_request(f"the request body is larger than the limit of {limit} bytes (--max-request-bytes)",
                       None, "request_too_large")  # fmt: skip


def _check_key(request: Request, key: str | None) -> None:
    if key is None:
        return
    header = request.headers.get("authorization", "")
    given = header[7:].strip() if header[:7].lower() == "bearer " else ""
    if not given:
        raise APIError(401, "missing API key: send 'Authorization: Bearer <key>'", code="invalid_api_key")
    if not hmac.compare_digest(given.encode(), key.encode()):
        raise APIError(401, "incorrect API key", code="invalid_api_key")


def _as_api_error(error: Exception) -> APIError:
    """The OpenAI error for anything a request raised."""
    if isinstance(error, APIError):
        return error
    if isinstance(error, ServerBusy):
        return APIError(503, f"the server is busy: {error}", code="server_busy")
    if isinstance(error, EngineClosedError):  # the engine thread stopped: nothing can be served now
        return APIError(503, f"the server cannot generate: {error}", code="engine_stopped")
    if isinstance(error, PromptTooLongError):
        detail = str(error).removeprefix("conversation 0: ")
        return bad_request(f"prompt length limit (--max-model-len): {detail}", "messages", "context_length_exceeded")
    if isinstance(error, ValueError):  # the processor / pipeline refused the input (bad image, video, ...)
        return bad_request(str(error), "messages")
    log.exception("internal error", exc_info=error)
    return APIError(500, f"internal error: {type(error).__name__}: {error}")


def _error_response(error: APIError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status)


def _port(text: str) -> int:
    if not text.isdigit() or int(text) > 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a TCP port: give 0-65535")
    return int(text)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m app.serve", description="OpenAI-compatible server for "
                                     "Qwen3.5 / Qwen3.6 (chat completions with images, videos, tools)")  # fmt: skip
    add_model_arguments(parser)
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0: every interface)")
    parser.add_argument("--port", type=_port, default=8000, help="TCP port, 0-65535 (default: 8000)")
    parser.add_argument("--api-key", default=os.environ.get("QWEN35_API_KEY"),
                        help="require 'Authorization: Bearer KEY' on /v1 (default: $QWEN35_API_KEY; none: open)")
    parser.add_argument("--served-model-name", default=None,
                        help="the model id clients send (default: the checkpoint folder's name; 'default' "
                             "for the built-in model)")  # fmt: skip
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="context limit in tokens, prompt + max_tokens (default: the model's)")
    parser.add_argument("--allowed-local-media-path", type=Path, default=None, metavar="DIR",
                        help="serve file:// URLs and local paths under DIR (default: none)")
    _add_media_arguments(parser)
    defaults, media = Limits(), Limits().media
    for flag, value, what in (
        ("--max-request-bytes", defaults.max_request_bytes, "request body size limit"),
        ("--max-media-bytes", media.max_bytes, "size limit of one image or video"),
        ("--max-media-pixels", media.max_pixels, "pixel budget of one image, or of one video's sampled frames "
                                                 "together: larger ones are scaled down while decoding"),
        ("--media-fetch-workers", media.fetch_workers, "http(s) media fetches running at once"),
        ("--max-images", defaults.max_images, "images per request"),
        ("--max-videos", defaults.max_videos, "videos per request"),
        ("--max-video-frames", defaults.max_video_frames, "frames per video (also the default sampling cap)"),
        ("--default-max-tokens", defaults.default_max_tokens, "max_tokens when a request gives none "
                                                              "(at most half the context)"),
        ("--max-waiting", 256, "requests waiting for their turn; more get a 503"),
    ):  # fmt: skip
        parser.add_argument(flag, type=int, default=value, help=f"{what} (default: {value})")
    parser.add_argument("--media-fetch-timeout", type=float, default=media.remote.timeout,
                        help=f"seconds for the whole fetch of one http(s) image or video, redirects included "
                             f"(default: {media.remote.timeout:g})")
    parser.add_argument("--queue-timeout", type=float, default=600.0,
                        help="seconds a request may wait for its turn before a 503 (default: 600)")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    return parser.parse_args(argv)


def _add_media_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--allow-remote-media", action=argparse.BooleanOptionalAction, default=None,
                        help="fetch http(s) media URLs from any host (default: yes when --host is a loopback "
                             "address, no otherwise)")  # fmt: skip
    parser.add_argument("--allowed-media-hosts", default=None, metavar="HOST[,HOST...]",
                        help="fetch http(s) media only from these host names (default: none)")
    parser.add_argument("--allow-private-media", action="store_true",
                        help="also fetch from private, loopback and link-local addresses (default: refused, "
                             "checked after DNS resolution and on every redirect)")  # fmt: skip


def fetch_policy(args: argparse.Namespace) -> FetchPolicy:
    """Which media URLs the server fetches: remote media by default only when it listens on loopback."""
    hosts = None
    if args.allowed_media_hosts is not None:
        hosts = frozenset(h.strip().lower() for h in args.allowed_media_hosts.split(",") if h.strip())
    remote = args.allow_remote_media if args.allow_remote_media is not None else _is_loopback(args.host)
    return FetchPolicy(allow_remote=remote, allowed_hosts=hosts, allow_private=args.allow_private_media,
                       timeout=args.media_fetch_timeout)  # fmt: skip


def _is_loopback(host: str) -> bool:
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve to any interface
        return False


def build_server(args: argparse.Namespace) -> tuple[FastAPI, Backend]:
    """Load the model named by `args` and make the app (no serving yet)."""
    path = check_model(args.model)  # config.json and tokenizer first; the random-weights notice when no --model
    pipeline = load_pipeline(path, **pipeline_options(args))
    if args.max_model_len is not None:
        if args.max_model_len < 2:
            raise ValueError("--max-model-len must be at least 2")
        pipeline.max_context = min(pipeline.max_context, args.max_model_len)
    media = MediaPolicy(max_bytes=args.max_media_bytes, remote=fetch_policy(args),
                        allowed_local=args.allowed_local_media_path, max_pixels=args.max_media_pixels,
                        fetch_workers=args.media_fetch_workers)  # fmt: skip
    limits = Limits(max_request_bytes=args.max_request_bytes, max_images=args.max_images, max_videos=args.max_videos,
                    max_video_frames=args.max_video_frames, default_max_tokens=args.default_max_tokens,
                    media=media)  # fmt: skip
    name = args.served_model_name or ("default" if args.model is None else Path(path).name)
    backend = Backend(pipeline, queue_timeout=args.queue_timeout, max_waiting=args.max_waiting)
    return create_app(backend, ServeConfig(name, args.api_key, limits)), backend


def main(argv: list[str] | None = None) -> None:
    """Serve until interrupted."""
    import uvicorn

    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.allowed_local_media_path is not None and not args.allowed_local_media_path.is_dir():
        raise SystemExit(f"error: --allowed-local-media-path {args.allowed_local_media_path} is not a folder")
    try:
        app, _ = build_server(args)
    except (FileNotFoundError, ValueError) as error:
        raise SystemExit(f"error: {error}") from None
    if args.model is None:
        log.warning("serving the built-in default model: its weights are RANDOM, its answers meaningless")
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, access_log=False)


if __name__ == "__main__":
    main()
