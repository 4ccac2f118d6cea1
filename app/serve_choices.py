"""`n` > 1 choices of one chat request: choice 0 runs first, and once its first piece came (its prompt
prefilled, and so in the engine's prefix cache) the others start and resume from that cached prompt,
so the prompt is prefilled once. With a `seed`, choice i samples with seed + i; greedy choices are
alike. Their pieces interleave as they come (each chunk names its choice's index)."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Callable
from typing import Any

from lm.sampling import SEED_MAX, SamplingParams

from . import serve_response as shape
from .openai_protocol import ChatCompletionRequest
from .serve_backend import Backend, Generation
from .serve_chat import ChatJob

_END = object()


def choice_params(params: SamplingParams, i: int) -> SamplingParams:
    """Choice i's sampling parameters: its own seed (seed + i) when the request has one."""
    if params.seed is None or i == 0:
        return params
    seed = params.seed + i if params.seed + i <= SEED_MAX else params.seed - i
    return dataclasses.replace(params, seed=seed)


def choice_job(job: ChatJob, i: int) -> ChatJob:
    """Choice i's job (i > 0): its own sampling parameters, and its own rule, made when it starts
    (a rule keeps one answer's state; the request's was checked at admission)."""
    return dataclasses.replace(job, params=choice_params(job.params, i), answer_rule=None)


class Choices:
    """The n generations of one request; `cancel()` withdraws them all."""

    def __init__(self, backend: Backend, job: ChatJob, first_generation: Generation, events: AsyncIterator[Any],
                 first: Any, n: int, in_thinking: bool):  # fmt: skip
        self.generations = [first_generation] + [
            backend.start(choice_job(job, i)) for i in range(1, n)]
        self.streams = [shape.AnswerStream(in_thinking=in_thinking, tools=job.tools,
                                           include_reasoning=job.include_reasoning) for _ in range(n)]  # fmt: skip
        self.queue: asyncio.Queue = asyncio.Queue()
        self.tasks = [asyncio.create_task(self._pump(0, events, first))] + [
            asyncio.create_task(self._pump(i, g.events(), _END)) for i, g in enumerate(self.generations) if i]

    async def _pump(self, i: int, events: AsyncIterator[Any], first: Any) -> None:
        try:
            item = await anext(events, None) if first is _END else first
            while isinstance(item, str):
                await self.queue.put((i, item))
                item = await anext(events, None)
            await self.queue.put((i, item))  # the Output, or None when cancelled
        except Exception as error:  # noqa: BLE001 - handed to the response
            await self.queue.put((i, error))

    async def items(self) -> AsyncIterator[tuple[int, Any]]:
        """(choice, text piece) as they come, then (choice, Output) for each; raises a choice's error."""
        left = len(self.generations)
        while left:
            i, item = await self.queue.get()
            if isinstance(item, Exception):
                raise item
            if not isinstance(item, str):
                left -= 1
            yield i, item

    def cancel(self) -> None:
        for generation in self.generations:
            generation.cancel()
        for task in self.tasks:
            task.cancel()


async def complete(model: str, rid: str, choices: Choices,
                   decode: Callable[[int], str]) -> tuple[dict[str, Any] | None, list[Any]]:  # fmt: skip
    """The non-streamed body of all choices and their outputs (None, [] when one was cancelled: the
    client is gone)."""
    deltas: list[list] = [[] for _ in choices.generations]
    outputs: list[Any] = [None] * len(deltas)
    async for i, item in choices.items():
        if isinstance(item, str):
            deltas[i] += choices.streams[i].feed(item)
        elif item is None:
            return None, []
        else:
            deltas[i] += choices.streams[i].finish()
            outputs[i] = item
    bodies = [shape.completion(rid, model, shape.now(), d, o, s.calls, decode)
              for d, o, s in zip(deltas, outputs, choices.streams)]  # fmt: skip
    body = bodies[0]
    body["choices"] = [dict(b["choices"][0], index=i) for i, b in enumerate(bodies)]
    body["usage"] = total_usage(outputs)
    return body, outputs


def total_usage(outputs: list[Any]) -> dict[str, Any]:
    """The request's usage: the prompt once, the completions of every choice."""
    completion = sum(o.completion_tokens for o in outputs)
    return {"prompt_tokens": outputs[0].prompt_tokens, "completion_tokens": completion,
            "total_tokens": outputs[0].prompt_tokens + completion,
            "completion_tokens_details": {"reasoning_tokens": sum(o.reasoning_tokens for o in outputs)}}  # fmt: skip


async def stream(chat: ChatCompletionRequest, model: str, rid: str, choices: Choices,
                 decode: Callable[[int], str], done: Callable[[list[Any]], None]) -> AsyncIterator[str]:  # fmt: skip
    """The streamed chunks of all choices (`done(outputs)` once every choice finished)."""
    created = shape.now()
    with_usage = bool(chat.stream_options and chat.stream_options.include_usage)
    cursors = [shape.LogprobsCursor(decode) for _ in choices.generations]

    def send(i: int, delta: dict[str, Any], finish: str | None = None) -> str:
        logprobs = None
        answer = choices.generations[i].answer
        if chat.logprobs and answer is not None and (delta or finish):
            logprobs = cursors[i].next(answer.request)
        body = shape.chunk(rid, model, created, delta, finish, with_usage=with_usage, logprobs=logprobs)
        body["choices"][0]["index"] = i
        return shape.event(body)

    outputs: list[Any] = [None] * len(cursors)
    for i in range(len(cursors)):
        yield send(i, {"role": "assistant", "content": ""})
    async for i, item in choices.items():
        if isinstance(item, str):
            for delta in choices.streams[i].feed(item):
                yield send(i, delta)
        elif item is None:
            return
        else:
            for delta in choices.streams[i].finish():
                yield send(i, delta)
            outputs[i] = item
            yield send(i, {}, shape.finish_reason(item, choices.streams[i].calls))
    done(outputs)
    if with_usage:
        yield shape.event(shape.chunk(rid, model, created, None, usage_=total_usage(outputs), with_usage=True))
    yield "data: [DONE]\n\n"
