"""What a caller hands the serving engine and gets back: `Prompt`, `Request`, and their errors."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch

from ..sampling import SamplingParams
from .speculative import SpeculativeStats


class RequestTooLargeError(ValueError):
    """A request that does not fit in the engine's memory even when it is alone."""


class EngineClosedError(RuntimeError):
    """The engine was closed before the request finished."""


@dataclass
class Prompt:
    """What the engine needs of one prompt.

    `key` identifies the prompt's content for the prefix cache (default: the token ids; media
    placeholders must be replaced by content hashes, or two images would share a prefix).
    `embed(start, end)` returns the input embeddings [1, end - start, hidden] of tokens
    [start, end) (default: the token embeddings). `positions` [3, T] are mRoPE positions (default:
    text positions) and `next_position` the position of the first generated token (default T).
    """

    token_ids: list[int]
    key: Sequence[int] | None = None
    embed: Callable[[int, int], torch.Tensor] | None = None
    positions: torch.Tensor | None = None
    next_position: int | None = None
    snapshot_at: tuple[int, ...] = ()


class Request:
    """A submitted request. Iterate it (from any one thread) for its tokens as they come; it ends
    when the request finishes, and raises the engine's error if the request failed."""

    def __init__(self, engine, rid: int, prompt: Prompt, params: SamplingParams, stop_when, rule):
        self.engine, self.id, self.prompt, self.params, self.stop_when = engine, rid, prompt, params, stop_when
        self.rule = rule
        self.tokens: list[int] = []  # written by the engine thread
        self.token_times: list[float] = []  # perf_counter() when each token was sampled
        # with params.logprobs: per token, (its log-probability, [(id, log-probability)] of the most likely)
        self.logprobs: list[tuple[float, list[tuple[int, float]]]] = []
        self.finish_reason: str | None = None  # "stop", "length" or "cancelled"
        self.error: BaseException | None = None
        self.cached_tokens = 0  # prompt tokens taken from the prefix cache
        self.speculative = SpeculativeStats()  # its drafts, when it decodes speculatively (drafts.py)
        self.times: dict[str, float] = dict(submitted=time.perf_counter())
        self._events: queue.SimpleQueue = queue.SimpleQueue()
        self._cancelled = threading.Event()
        self._finished = threading.Event()
        self.admitted = threading.Event()  # set when the request starts its prefill (or ends before)

    def __iter__(self) -> Iterator[int]:
        while True:
            kind, value = self._events.get()
            if kind == "token":
                yield value
            elif kind == "end":
                return
            else:
                raise value

    def result(self) -> list[int]:
        """Wait for the end (whether or not the tokens were iterated); all generated tokens."""
        self._finished.wait()
        if self.error is not None:
            raise self.error
        return self.tokens

    def cancel(self) -> None:
        """Stop generating (any thread); the slot is freed at the engine's next step."""
        if not self._finished.is_set():
            self._cancelled.set()
            self.engine._wake()

    @property
    def done(self) -> bool:
        return self._finished.is_set()

    # engine side
    def _admit(self) -> None:
        self.times["admitted"] = time.perf_counter()
        self.admitted.set()

    def _token(self, token: int) -> None:
        self.tokens.append(token)
        self.token_times.append(time.perf_counter())
        self.times.setdefault("first_token", time.perf_counter())
        self._events.put(("token", token))

    def _end(self, reason: str | None, error: BaseException | None = None) -> None:
        self.finish_reason, self.error = reason, error
        self.times["finished"] = time.perf_counter()
        self.admitted.set()
        self._finished.set()
        self._events.put(("error", error) if error is not None else ("end", reason))
