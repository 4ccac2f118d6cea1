"""The serving engine's front: one background thread that owns the model, and the calls any thread
may make (`submit`, `Request.cancel`, `close`, `stats`). What each step does is the scheduler's
(scheduler.py); see lm/serving/__init__.py for the whole."""

from __future__ import annotations

import sys
import threading
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import torch

from .. import kernels
from ..model import CausalLM
from ..sampling import SamplingParams, TokenRule
from .config import EngineConfig
from .request import EngineClosedError, Prompt, Request, RequestTooLargeError
from .scheduler import Scheduler


class Engine:
    """Continuous batching over `config`'s slots (EngineConfig; keyword options replace its fields:
    `Engine(lm, max_batch=4)`)."""

    def __init__(self, lm: CausalLM, *, eos_token_ids: Sequence[int] = (), config: EngineConfig | None = None,
                 **options):  # fmt: skip
        self.lm, self.eos = lm, tuple(eos_token_ids)
        self.config = EngineConfig.of(config, **options)
        self.scheduler = Scheduler(lm, self.eos, self.config)
        self.max_batch, self.max_len = self.config.max_batch, self.scheduler.max_len
        self.store, self.prefix, self.counters = self.scheduler.store, self.scheduler.prefix, self.scheduler.counters
        self._cond = threading.Condition()
        self._inbox: deque[Request] = deque()
        self._closed = False
        self._next_id = 0
        self._thread: threading.Thread | None = None
        self.dead: BaseException | None = None  # why the engine thread stopped, if it ever did

    # -- any thread ----------------------------------------------------------------------------
    def submit(self, prompt: Prompt | Sequence[int], params: SamplingParams | None = None, *,
               stop_when: Callable[[list[int]], bool] | None = None,
               rule: Callable[[list[int]], TokenRule | None] | None = None) -> Request:  # fmt: skip
        """Queue a request; returns its handle at once. `stop_when(tokens)` may end it early
        ("stop"), e.g. on a stop string; `rule(tokens)` may constrain its next token (a `TokenRule`,
        or None: free). RequestTooLargeError when it cannot fit in one slot."""
        prompt = prompt if isinstance(prompt, Prompt) else Prompt(list(prompt))
        params = params or SamplingParams()
        t = len(prompt.token_ids)
        if params.constrained and rule is None:
            raise ValueError("json_schema, regex, grammar and thinking_budget are enforced by a rule: generate "
                             "through mm.Pipeline, which makes it (mm/constraints.py)")  # fmt: skip
        if t == 0:
            raise ValueError("an empty prompt: give at least one token")
        if prompt.key is not None and len(prompt.key) != t:
            raise ValueError(f"a prompt key of {len(prompt.key)} entries for {t} tokens")
        need = t + params.max_new_tokens
        if need > self.max_len:
            raise RequestTooLargeError(
                f"this request needs {need} positions of cache (a {t}-token prompt + max_new_tokens="
                f"{params.max_new_tokens}), more than one slot of this engine holds ({self.max_len}); "
                "shorten it or make the engine with a larger max_len")  # fmt: skip
        if threading.current_thread() is not self._thread:  # this thread's work is done: its OpenMP workers
            kernels.release_openmp_workers()  # would slow the engine thread's (kernels.release_openmp_workers)
        with self._cond:
            if self.dead is not None:
                raise EngineClosedError(f"the engine stopped: {type(self.dead).__name__}: {self.dead}")
            if self._closed:
                raise EngineClosedError("the engine is closed")
            request = Request(self, self._next_id, prompt, params, stop_when, rule)
            self._next_id += 1
            self.counters["submitted"] += 1
            self._inbox.append(request)
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="qwen35-engine", daemon=True)
                self._thread.start()
            self._cond.notify()
        return request

    def close(self) -> None:
        """Stop the engine thread; unfinished requests end with EngineClosedError."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        self.join()

    def join(self, timeout: float | None = None) -> None:
        """Wait for the engine thread to end (after `close`, or after it stopped by an error)."""
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Hold the engine between steps: what is submitted meanwhile is admitted together at the
        next step (for tests and benchmarks that need requests to start at once)."""
        with self._cond:
            yield

    @property
    def alive(self) -> bool:
        """False once the engine thread has stopped by an error (then `dead` holds it)."""
        return self.dead is None

    def stats(self) -> dict:
        stats = self.scheduler.stats()
        stats["waiting"] += len(self._inbox)
        return dict(stats, alive=self.alive)

    def _wake(self) -> None:
        with self._cond:
            self._cond.notify()

    # -- the engine thread ---------------------------------------------------------------------
    def _loop(self) -> None:
        """The engine thread. A fault of one request fails that request (the scheduler's `_guard`);
        anything that still escapes a step fails the requests in flight and the loop goes on. Should
        the thread itself end by an error, `dead` says why and every later `submit` fails at once."""
        torch.set_grad_enabled(False)  # grad mode is per thread
        try:
            while self._turn():
                pass
        except BaseException as error:  # noqa: BLE001 - recorded for health checks and submit
            self.dead = error
            print(f"[qwen35] the engine thread stopped ({type(error).__name__}: {error})", file=sys.stderr)
            with self._cond:
                self._closed = True
                self._fail_all(EngineClosedError(f"the engine stopped: {type(error).__name__}: {error}"))

    def _turn(self) -> bool:
        """One pass of the loop: admit what arrived, run one step. False once closed."""
        with self._cond:
            while not self._closed and not (self._inbox or self.scheduler.busy):
                self._cond.wait()
            if self._closed:
                self._fail_all(EngineClosedError("the engine was closed"))
                return False
            while self._inbox:
                self.scheduler.admit(self._inbox.popleft())
        try:
            self.scheduler.step()
        except Exception as error:  # noqa: BLE001 - a failed step fails its requests, not the engine
            print(f"[qwen35] engine step failed ({type(error).__name__}: {error}); its requests end with "
                  "the error", file=sys.stderr)  # fmt: skip
            self.scheduler.fail_all(error)
        return True

    def _fail_all(self, error: BaseException) -> None:
        for request in self._inbox:
            self.counters["failed"] += 1
            request._end(None, error)
        self._inbox.clear()
        self.scheduler.fail_all(error)
