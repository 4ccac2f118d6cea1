"""The server's one use of the model: `Backend` hands each request's generation to the serving engine.

Every request becomes one request of the pipeline's engine (lm/serving): concurrent requests
share its batch (up to its slots; the rest wait in order) and its prefix cache. A request that
is not admitted within `queue_timeout` seconds, because every slot stays busy, is withdrawn and
answered with `ServerBusy` (a 503). A cancelled generation (the client went away) is withdrawn
from the engine at once, which frees its slot at the next step.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from typing import Any

from mm import Output, Pipeline
from mm.chat import collect_media, render

from .serve_chat import ChatJob


class ServerBusy(Exception):
    """The request waited longer than the queue timeout for its turn."""


class Backend:
    """Generations on one `mm.Pipeline`, batched by its engine."""

    def __init__(self, pipeline: Pipeline, *, queue_timeout: float = 600.0, max_waiting: int = 256):
        self.pipeline = pipeline
        self.queue_timeout, self.max_waiting = queue_timeout, max_waiting
        self._lock = threading.Lock()
        self._waiting = 0  # submitted, not yet admitted to a slot
        self.running = 0  # admitted and generating

    @property
    def waiting(self) -> int:
        return self._waiting

    @property
    def max_context(self) -> int:
        return self.pipeline.max_context

    def token_text(self, token: int) -> str:
        """The text of one token id (special tokens too), as logprobs name it."""
        return self.pipeline.processor.tokenizer.decode([token])

    def default_params(self):
        """The checkpoint's sampling defaults (generation_config.json)."""
        return self.pipeline.default_params()

    def render_prompt(self, conversation: list[dict[str, Any]], enable_thinking: bool | None,
                      template_kwargs: dict[str, Any]) -> str:  # fmt: skip
        """The prompt text the chat template makes of `conversation` (ValueError if it refuses it)."""
        processor = self.pipeline.processor
        messages, _ = collect_media(conversation, 0)
        return render(processor.tokenizer, processor.chat_template, messages, 0, add_generation_prompt=True,
                      enable_thinking=enable_thinking, template_kwargs=template_kwargs)  # fmt: skip

    @contextmanager
    def waiting_turn(self) -> Iterator[None]:
        """Count the caller as a waiting request while it prepares (fetches its media): `ServerBusy`
        when --max-waiting requests already wait."""
        self._enter_waiting()
        try:
            yield
        finally:
            self._count(-1, 0)

    def start(self, job: ChatJob) -> "Generation":
        """Start `job`; read its pieces with `Generation.events()`."""
        self._enter_waiting()
        generation = Generation(self, job, asyncio.get_running_loop())
        threading.Thread(target=generation.work, name="generation", daemon=True).start()
        return generation

    def _enter_waiting(self) -> None:
        with self._lock:
            if self._waiting >= self.max_waiting:
                raise ServerBusy(f"{self._waiting} requests are already waiting (the limit, --max-waiting)")
            self._waiting += 1

    def _count(self, waiting: int, running: int) -> None:
        with self._lock:
            self._waiting += waiting
            self.running += running


class Generation:
    """One request's generation, fed from a worker thread; `events()` yields its text pieces, then
    its `mm.Output`. `cancel()` withdraws it from the engine (its slot frees at the next step)."""

    def __init__(self, backend: Backend, job: ChatJob, loop: asyncio.AbstractEventLoop):
        self.backend, self.job, self.loop = backend, job, loop
        self.cancelled = threading.Event()
        self.queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        self.answer = None  # the pipeline's Answer, once submitted

    def cancel(self) -> None:
        self.cancelled.set()
        if self.answer is not None:
            self.answer.cancel()

    async def events(self) -> AsyncIterator[str | Output]:
        """Text pieces as they come, then the finished `Output`. Raises what the generation raised
        (e.g. ValueError for a prompt the processor refuses, `ServerBusy`)."""
        while True:
            kind, value = await self.queue.get()
            if kind == "piece":
                yield value
            elif kind == "done":
                yield value
                return
            elif kind == "error":
                raise value
            else:  # cancelled
                return

    def work(self) -> None:
        """The worker thread: submit, wait for a slot, then pass on the pieces."""
        running = False
        try:
            job = self.job
            self.answer = self.backend.pipeline.submit(job.conversation, job.params, enable_thinking=job.enable_thinking,
                                                       template_kwargs=job.template_kwargs, rule=job.rule,
                                                       answer_rule=job.answer_rule)  # fmt: skip
            if self.cancelled.is_set():
                self.answer.cancel()
            if not self._admitted():
                self.answer.cancel()
                last = ("cancelled", None) if self.cancelled.is_set() else ("error", ServerBusy(
                    f"no generation slot became free within {self.backend.queue_timeout:g} s (--queue-timeout)"))
            else:
                self.backend._count(-1, +1)
                running = True
                last = self._generate()
        except Exception as error:  # handed to the request, which maps it to an error response
            last = ("error", error)
        finally:
            if running:
                self.backend._count(0, -1)
            else:
                self.backend._count(-1, 0)
        self._put(*last)  # after the counts: whoever sees the end sees the backend free

    def _admitted(self) -> bool:
        """Wait until the engine gives the request a slot (or it ends); False on cancel or timeout."""
        request = self.answer.request
        deadline = time.monotonic() + self.backend.queue_timeout
        while not request.admitted.wait(timeout=0.05):
            if self.cancelled.is_set() or time.monotonic() > deadline:
                return False
        return not self.cancelled.is_set()

    def _generate(self) -> tuple[str, Any]:
        """Put each piece; return the last event: ("done", Output) or ("cancelled", None)."""
        answer = self.answer
        try:
            for _ in answer.request:
                if self.cancelled.is_set():
                    return "cancelled", None
                if piece := answer.new_text():
                    self._put("piece", piece)
            if self.cancelled.is_set() or answer.request.finish_reason == "cancelled":
                return "cancelled", None
            if piece := answer.new_text(final=True):
                self._put("piece", piece)
            return "done", answer.output()
        finally:
            answer.cancel()

    def _put(self, kind: str, value: Any) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, (kind, value))
        except RuntimeError:  # the event loop is gone (server shutting down)
            pass
