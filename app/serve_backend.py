"""The server's one use of the model: `Backend` runs each request's generation through `mm.Pipeline`.

Today's `mm.Pipeline` runs one generation at a time per call and is not made for concurrent calls,
so the backend runs one generation at a time, first come first served, each in a worker thread,
and requests queue for their turn (at most `queue_timeout` seconds, then `ServerBusy`, a 503).
When the serving engine (continuous batching) lands, only this file changes: `Generation` would
hand its job to the engine instead of taking the turn, and concurrent requests share the batch.

A cancelled generation (the client went away) stops after its current token and gives up its turn.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from collections.abc import AsyncIterator
from typing import Any

from mm import Output, Pipeline
from mm.chat import collect_media, render

from .serve_chat import ChatJob


class ServerBusy(Exception):
    """The request waited longer than the queue timeout for its turn."""


class Backend:
    """Generations on one `mm.Pipeline`, one at a time in arrival order."""

    def __init__(self, pipeline: Pipeline, *, queue_timeout: float = 600.0, max_waiting: int = 256):
        self.pipeline = pipeline
        self.queue_timeout, self.max_waiting = queue_timeout, max_waiting
        self._turn = threading.Condition()
        self._queue: deque[Generation] = deque()
        self._busy = False
        self.running = 0

    @property
    def waiting(self) -> int:
        return len(self._queue)

    @property
    def max_context(self) -> int:
        return self.pipeline.max_context

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

    def start(self, job: ChatJob) -> "Generation":
        """Queue `job`; read its pieces with `Generation.events()`."""
        if len(self._queue) >= self.max_waiting:
            raise ServerBusy(f"{len(self._queue)} requests are already waiting (the limit, --max-waiting)")
        generation = Generation(self, job, asyncio.get_running_loop())
        with self._turn:
            self._queue.append(generation)
        threading.Thread(target=generation.work, name="generation", daemon=True).start()
        return generation

    def _take_turn(self, generation: "Generation") -> bool:
        """Wait until `generation` is first in line and nothing runs; False if cancelled or timed out."""
        deadline = time.monotonic() + self.queue_timeout
        with self._turn:
            try:
                while self._busy or self._queue[0] is not generation:
                    left = deadline - time.monotonic()
                    if generation.cancelled.is_set() or left <= 0:
                        return False
                    self._turn.wait(timeout=min(left, 0.1))
                self._busy = True
                self.running += 1
                return True
            finally:
                self._queue.remove(generation)
                self._turn.notify_all()

    def _end_turn(self) -> None:
        with self._turn:
            self._busy = False
            self.running -= 1
            self._turn.notify_all()


class Generation:
    """One request's generation, run in a worker thread; `events()` yields its text pieces, then its
    `mm.Output`. `cancel()` stops it (between two tokens) and frees the backend for the next request."""

    def __init__(self, backend: Backend, job: ChatJob, loop: asyncio.AbstractEventLoop):
        self.backend, self.job, self.loop = backend, job, loop
        self.cancelled = threading.Event()
        self.queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()

    def cancel(self) -> None:
        self.cancelled.set()

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
        """The worker thread: wait for the turn, then pull pieces from `Pipeline.stream`."""
        if not self.backend._take_turn(self):
            if self.cancelled.is_set():
                self._put("cancelled", None)
            else:
                self._put("error", ServerBusy(f"no generation slot became free within {self.backend.queue_timeout:g} s "
                                              "(--queue-timeout)"))  # fmt: skip
            return
        try:
            last = self._generate()
        except Exception as error:  # handed to the request, which maps it to an error response
            last = ("error", error)
        finally:
            self.backend._end_turn()
        self._put(*last)  # after the turn ended: whoever sees the end sees the backend free

    def _generate(self) -> tuple[str, Any]:
        """Put each piece; return the last event: ("done", Output) or ("cancelled", None)."""
        job = self.job
        pieces = self.backend.pipeline.stream(job.conversation, job.params, enable_thinking=job.enable_thinking,
                                              template_kwargs=job.template_kwargs)  # fmt: skip
        try:
            while not self.cancelled.is_set():
                try:
                    piece = next(pieces)
                except StopIteration as end:
                    return "done", end.value
                self._put("piece", piece)
            return "cancelled", None
        finally:
            pieces.close()

    def _put(self, kind: str, value: Any) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, (kind, value))
        except RuntimeError:  # the event loop is gone (server shutting down)
            pass
