"""The serving engine: continuous batching with chunked prefill beside decode, and a prefix cache.

`Engine(lm)` runs one background thread that owns the model. Any thread may `submit` a request
(its prompt and its own `SamplingParams`) and iterate the returned `Request` for its tokens as they
are sampled, or `cancel()` it. Each engine step:

1. drops cancelled requests (a running row's slot is freed at once);
2. decodes one token for every running row together, each row at its own length (lm/slots.py:
   no shared write position, no left padding);
3. spends the rest of the step's token budget (`step_tokens`, default 128, minus the running rows)
   on the prompt at the head of the queue, in chunks: a long prompt arriving costs the running
   streams at most one chunk of prefill per token. With no stream running, a chunk is
   `prefill_chunk` tokens (1024), for throughput. Short text prompts without a cached prefix that
   wait together are prefilled together, left-padded in one forward. A prompt that finishes
   samples its first token and takes the next free slot.

Memory is bounded: `max_batch` slots (8: the decode kernels' row limit) of at most `max_len`
positions each (SlotStore), one prompt in prefill at a time, and the prefix cache's byte budget,
which holds every snapshot (a copy too large for the whole budget is never made). A prompt takes at
most `named_snapshots` of the snapshots its caller names (one per message would be a copy of the
state per message: 5,000 short messages, 5,000 copies of a growing KV cache).
Requests beyond the free slots wait in order, never dropped; a request that cannot fit in one slot
(prompt + max_new_tokens > max_len) is refused at `submit` with `RequestTooLargeError`.

Prefix cache (lm/prefix_cache.py): before its prefill, a request resumes from the longest stored
snapshot whose key starts its own key, and prefills only the rest. Snapshots are taken at the end
of each prompt, at the prompt positions the caller names (`Prompt.snapshot_at`: the chat front end
names each message's start and the start of the assistant turn, where the next turn's history
diverges; at most `named_snapshots` of them: the first and the last ones), where the prompt leaves
the longest prefix it shares with a stored snapshot's key,
every `snapshot_every` tokens of long prompts, and at the end of each generation.

Greedy outputs equal one-request-at-a-time generation (`stream_generate` with batch 1): every row
is computed as it would be alone; tests/lm/test_scheduler.py checks this token for token.
"""

from __future__ import annotations

import os
import queue
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from . import kernels
from .decode import step_tokens
from .model import CausalLM
from .prefix_cache import PrefixCache
from .sampling import Sampler, SamplingParams, TokenRule
from .slots import SlotStore, resumed, row_state, trimmed


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

    def __init__(self, engine: "Engine", rid: int, prompt: Prompt, params: SamplingParams, stop_when, rule):
        self.engine, self.id, self.prompt, self.params, self.stop_when = engine, rid, prompt, params, stop_when
        self.rule = rule
        self.tokens: list[int] = []  # written by the engine thread
        self.token_times: list[float] = []  # perf_counter() when each token was sampled
        self.finish_reason: str | None = None  # "stop", "length" or "cancelled"
        self.error: BaseException | None = None
        self.cached_tokens = 0  # prompt tokens taken from the prefix cache
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


@dataclass
class _Row:
    """The engine's state of one admitted request."""

    request: Request
    sampler: Sampler
    key: tuple
    stops: list[int]  # prompt positions where a snapshot is taken, ascending (the last is T)
    cache: object = None  # the batch-1 prefill cache while prefilling
    done: int = 0  # prompt tokens in the cache
    next_pos: int = 0
    logits: torch.Tensor | None = None  # of the last position in the cache
    reason: str | None = None  # why it ended, once it has (set before its slot is freed)


def default_prefix_cache_bytes() -> int:
    """2 GiB, or an eighth of the machine's memory when that is less."""
    try:
        ram = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        ram = 16 << 30
    return min(2 << 30, ram // 8)


class Engine:
    def __init__(self, lm: CausalLM, *, eos_token_ids: Sequence[int] = (), max_batch: int = 8,
                 max_len: int | None = None, step_tokens: int = 128, prefill_chunk: int = 1024,
                 prefix_cache_bytes: int | None = None, snapshot_every: int = 512, named_snapshots: int = 8,
                 snapshot_generations: bool = True):  # fmt: skip
        if min(max_batch, step_tokens, prefill_chunk, snapshot_every, named_snapshots) < 1:
            raise ValueError("max_batch, step_tokens, prefill_chunk, snapshot_every and named_snapshots must be >= 1")
        self.lm, self.eos = lm, tuple(eos_token_ids)
        self.max_batch, self.step_tokens, self.prefill_chunk = max_batch, step_tokens, prefill_chunk
        self.max_len = max_len or min(lm.config.max_position_embeddings, 32768)
        self.snapshot_every, self.snapshot_generations = snapshot_every, snapshot_generations
        self.named_snapshots = named_snapshots
        device = lm.lm_head.weight.device
        self.store = SlotStore(lm.config, max_batch, self.max_len, device=device, dtype=lm.compute_dtype)
        self.prefix = PrefixCache(default_prefix_cache_bytes() if prefix_cache_bytes is None else prefix_cache_bytes)
        self.counters = dict(steps=0, decode_tokens=0, prefill_tokens=0, grouped_prefills=0, submitted=0, finished=0,
                             cancelled=0, failed=0)  # fmt: skip
        self._cond = threading.Condition()
        self._inbox: deque[Request] = deque()
        self._waiting: deque[_Row] = deque()
        self._prefilling: _Row | None = None
        self._running: list[_Row] = []  # row i lives in slot i
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
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()

    @property
    def alive(self) -> bool:
        """False once the engine thread has stopped by an error (then `dead` holds it)."""
        return self.dead is None

    def stats(self) -> dict:
        return dict(self.counters, alive=self.alive, running=len(self._running),
                    waiting=len(self._waiting) + len(self._inbox), prefilling=int(self._prefilling is not None), slot_bytes=self.store.nbytes(),
                    slot_max_bytes=self.store.max_bytes(), prefix=self.prefix.stats())  # fmt: skip

    def _wake(self) -> None:
        with self._cond:
            self._cond.notify()

    # -- the engine thread ---------------------------------------------------------------------
    def _loop(self) -> None:
        """The engine thread. A fault of one request fails that request (see `_guard`); anything
        that still escapes a step fails the requests in flight and the loop goes on. Should the
        thread itself end by an error, `dead` says why and every later `submit` fails at once."""
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
            while not self._closed and not (self._inbox or self._waiting or self._prefilling or self._running):
                self._cond.wait()
            if self._closed:
                self._fail_all(EngineClosedError("the engine was closed"))
                return False
            while self._inbox:
                request = self._inbox.popleft()
                with self._guard(request):
                    self._waiting.append(self._admit_row(request))
        try:
            self._step()
        except Exception as error:  # noqa: BLE001 - a failed step fails its requests, not the engine
            print(f"[qwen35] engine step failed ({type(error).__name__}: {error}); its requests end with "
                  "the error", file=sys.stderr)  # fmt: skip
            self._fail_all(error)
        return True

    @contextmanager
    def _guard(self, request: Request, row: "_Row | None" = None):
        """Run one request's part of a step; an exception there ends that request with the error
        (its slot, if any, is freed by the caller) and the engine goes on with the others."""
        try:
            yield
        except Exception as error:  # noqa: BLE001 - one request's fault is that request's
            self._fail(request, error, row)

    def _fail(self, request: Request, error: BaseException, row: "_Row | None" = None) -> None:
        """End `request` (and its row, if admitted) with `error`, said on stderr; once."""
        print(f"[qwen35] request {request.id} failed ({type(error).__name__}: {error})", file=sys.stderr)
        if row is not None:
            row.cache = None  # its prefill cache, whatever becomes of the request
        if request.done:
            return
        if row is not None:
            self._finish(row, None, error)
        else:
            self.counters["failed"] += 1
            request._end(None, error)

    def _admit_row(self, request: Request) -> _Row:
        p = request.prompt
        t = len(p.token_ids)
        key = tuple(p.key) if p.key is not None else tuple(p.token_ids)
        stops = sorted(self._named_stops(p.snapshot_at, t) | set(range(self.snapshot_every, t, self.snapshot_every))
                       | {t})  # fmt: skip
        sampler = Sampler([request.params], [list(p.token_ids)], device=self.store.device)
        return _Row(request, sampler, key, stops, next_pos=p.next_position if p.next_position is not None else t)

    def _named_stops(self, points: Sequence[int], t: int) -> set[int]:
        """The caller's snapshot points inside a prompt of `t` tokens, at most `named_snapshots`: the
        first (after a shared system prompt) and the last ones (where the next chat turn leaves)."""
        points = sorted({s for s in points if 0 < s < t})
        if len(points) > self.named_snapshots:
            points = points[:1] + points[len(points) - self.named_snapshots + 1 :]
        return set(points)

    def _snapshot(self, key: tuple, cache, logits: torch.Tensor) -> None:
        """Store a copy of a batch-1 cache's state (len(key) positions) in the prefix cache, unless
        the copy alone would exceed its whole budget: then it is never made."""
        size = len(key) * (self.store.kv_bytes_per_token() + 1) + self.store.state_bytes()  # + 1: the key mask
        if size + logits.numel() * logits.element_size() <= self.prefix.max_bytes:
            self.prefix.insert(key, trimmed(cache, copy=True), logits)

    def _step(self) -> None:
        self.counters["steps"] += 1
        self._drop_cancelled()
        decoding = len(self._running)
        if decoding:
            self._decode()
        budget = max(1, self.step_tokens - decoding) if decoding else self.prefill_chunk
        while budget > 0:
            if self._prefilling is None:
                if not self._waiting or len(self._running) >= self.max_batch:
                    break
                group = self._cold_group(budget)
                if len(group) >= 2:
                    budget -= self._prefill_group(group)
                else:
                    row = self._waiting.popleft()
                    with self._guard(row.request, row):
                        self._start_prefill(row)
                continue
            row = self._prefilling
            try:
                budget -= self._prefill(row, budget)
            except Exception as error:  # noqa: BLE001 - e.g. an image the vision tower cannot take
                self._prefilling = None
                self._finish(row, None, error)

    def _drop_cancelled(self) -> None:
        for row in [r for r in self._waiting if r.request._cancelled.is_set()]:
            self._waiting.remove(row)
            self._finish(row, "cancelled")
        if self._prefilling is not None and self._prefilling.request._cancelled.is_set():
            row, self._prefilling = self._prefilling, None
            self._finish(row, "cancelled")
        for i in reversed(range(len(self._running))):
            if self._running[i].request._cancelled.is_set():
                self._finish(self._remove(i), "cancelled")

    def _start_prefill(self, row: _Row) -> None:
        t = len(row.key)
        row.request._admit()
        snap = self.prefix.lookup(row.key)
        row.request.cached_tokens = len(snap.key) if snap is not None else 0
        if snap is not None and len(snap.key) == t:  # the whole prompt is cached: decode at once
            row.done, row.logits = t, snap.logits
            self._begin_decoding(row, snap.state)
            return
        shared = self.prefix.shared_length(row.key)  # where this prompt leaves one seen before
        if row.request.cached_tokens < shared < t and shared not in row.stops:
            row.stops = sorted([*row.stops, shared])
        if snap is not None:
            row.cache, row.done = resumed(snap.state, t), len(snap.key)
        else:
            row.cache, row.done = self.lm.make_cache(1, t), 0
        self._prefilling = row

    def _cold_group(self, budget: int) -> list[_Row]:
        """The waiting text prompts at the head of the queue that can be prefilled together in one
        left-padded forward: none has a cached prefix, they fit the free slots, and the padded
        batch fits the budget. (Each prefill chunk pays a fixed cost, e.g. converting bf16 weights
        to float32 once per chunk; several short prompts in one chunk pay it once.)"""
        group: list[_Row] = []
        longest = 0
        for row in self._waiting:
            t = len(row.key)
            fits = len(self._running) + len(group) < self.max_batch and (len(group) + 1) * max(longest, t) <= budget
            if not fits or row.request.prompt.positions is not None or self.prefix.lookup(row.key, count=False):
                break
            group.append(row)
            longest = max(longest, t)
        return group

    def _prefill_group(self, group: list[_Row]) -> int:
        """Prefill `group` (see `_cold_group`) in one forward; each row then decodes from its slot.
        Left padding leaves each row's state exactly as alone (padding writes nothing into the
        DeltaNet states and is masked in attention)."""
        for _ in group:
            self._waiting.popleft()
        b, width = len(group), max(len(r.key) for r in group)
        embeds = torch.zeros(b, width, self.lm.config.hidden_size, dtype=self.lm.compute_dtype, device=self.store.device)
        mask = torch.zeros(b, width, dtype=torch.long, device=self.store.device)
        live = []
        for i, row in enumerate(group):
            row.request._admit()
            t = len(row.key)
            self.prefix.count(t, 0)  # _cold_group found no cached prefix
            try:
                embeds[i, width - t :] = self._embeds(row.request.prompt, 0, t)[0]
            except Exception as error:  # noqa: BLE001 - this prompt fails alone
                self._finish(row, None, error)
                continue
            mask[i, width - t :] = 1
            live.append(i)
        try:
            cache = self.lm.make_cache(b, width)
            logits = self.lm(inputs_embeds=embeds, attention_mask=mask, cache=cache, last_only=True)[:, -1]
        except Exception as error:  # noqa: BLE001 - the group's requests fail, the engine goes on
            for i in live:
                self._fail(group[i].request, error, group[i])
            return b * width
        self.counters["prefill_tokens"] += int(mask.sum())
        self.counters["grouped_prefills"] += 1
        for i in live:
            row, t = group[i], len(group[i].key)
            with self._guard(row.request, row):
                state = row_state(cache, i, width - t)
                self._snapshot(row.key, state, logits[i])
                row.done, row.logits = t, logits[i]
                self._begin_decoding(row, state)
        return b * width

    def _prefill(self, row: _Row, budget: int) -> int:
        """One chunk of the row's prompt (ending at the next snapshot point); returns its tokens."""
        p, start = row.request.prompt, row.done
        end = min(start + budget, next(s for s in row.stops if s > start))
        positions = p.positions[:, None, start:end] if p.positions is not None else None
        logits = self.lm(inputs_embeds=self._embeds(p, start, end), positions=positions, cache=row.cache,
                         last_only=True)[0, -1]  # fmt: skip
        row.done, row.logits = end, logits
        self.counters["prefill_tokens"] += end - start
        t = len(row.key)
        if end < t:
            if end in row.stops:
                self._snapshot(row.key[:end], row.cache, logits)
            return end - start
        self.prefix.insert(row.key, trimmed(row.cache, copy=False), logits)
        self._prefilling = None
        self._begin_decoding(row, row.cache)
        row.cache = None
        return end - start

    def _embeds(self, prompt: Prompt, start: int, end: int) -> torch.Tensor:
        """Input embeddings [1, end - start, hidden] of the prompt's tokens [start, end)."""
        if prompt.embed is not None:
            return prompt.embed(start, end)
        return self.lm.embed(torch.tensor([prompt.token_ids[start:end]], device=self.store.device))

    def _begin_decoding(self, row: _Row, state) -> None:
        """The prompt is in `state` and its last logits in row.logits: sample the first token and,
        unless that ends the request, put the row in the next free slot."""
        if self._sample(row, row.logits) is not None:
            return
        slot = len(self._running)
        self.store.load(slot, state)
        self._running.append(row)

    def _decode(self) -> None:
        n, running = len(self._running), self._running
        lengths = self.store.lengths[:n].tolist()  # each row's positions in the cache
        self.store.ensure(max(lengths) + 1)
        view = self.store.view(n, max(lengths))
        tokens, positions = [r.request.tokens[-1] for r in running], [r.next_pos for r in running]
        # the CPU decode plan's step from Python ints (lm/decode.py; each tensor operation here runs
        # cache-cold after a step), once the model's first step on this view has made it; else the model
        try:
            logits = step_tokens(view, tokens, positions, lengths)  # (its states are updated in place)
            if logits is None:
                device = self.store.device
                ids = torch.tensor([[token] for token in tokens], device=device)
                pos = torch.tensor(positions, device=device)[None, :, None].expand(3, n, 1)
                logits = self.lm(ids, positions=pos, cache=view)[:, -1]
                self.store.sync(view, n)
        except Exception as error:  # noqa: BLE001 - the rows' states are unknown now: they fail, the rest go on
            while self._running:
                row = self._remove(len(self._running) - 1)
                self._fail(row.request, error, row)
            return
        self.counters["decode_tokens"] += n
        # every row greedy with no penalty and no rule: one argmax call for all (lm/sampling.py)
        picks = None
        if all(r.sampler.plain_greedy and r.request.rule is None for r in running):
            picks = running[0].sampler.argmax_all(logits)
        ended = []
        for i, row in enumerate(running):
            row.next_pos += 1
            with self._guard(row.request, row):
                if self._sample(row, logits[i], finish=False, token=None if picks is None else picks[i]) is not None:
                    ended.append(i)
            if row.request.done:  # its sampling failed
                ended.append(i)
        for i in sorted(ended, reverse=True):
            row = self._running[i]
            if row.request.done:
                self._remove(i)
                continue
            if self.snapshot_generations and self.prefix.max_bytes and len(row.request.tokens) >= 2:
                key = row.key + tuple(row.request.tokens[:-1])
                self.prefix.insert(key, self.store.save(i), row.logits)
            self._finish(self._remove(i), row.reason)

    def _sample(self, row: _Row, logits: torch.Tensor, finish: bool = True, token: int | None = None) -> str | None:
        """Sample (unless `token`, the row's pick, is given) and emit one token; returns the finish
        reason when it ends the request (finished at once unless `finish` is False: then the caller
        frees the slot first)."""
        request = row.request
        row.logits = logits
        if token is None:
            if request.rule is not None and (rule := request.rule(request.tokens)) is not None:
                logits = rule.apply(logits)
            token = row.sampler(logits[None], [0], [request.tokens])[0]
        request._token(token)
        reason = None
        if token in self.eos or token in request.params.stop_token_ids:
            reason = "stop"
        elif len(request.tokens) >= request.params.max_new_tokens:
            reason = "length"
        elif request.stop_when is not None and request.stop_when(request.tokens):
            reason = "stop"
        if reason is not None:
            if finish:
                self._finish(row, reason)
            else:
                row.reason = reason
        return reason

    def _remove(self, i: int) -> _Row:
        """Free running row i's slot: the last row moves into it."""
        row, last = self._running[i], len(self._running) - 1
        if i != last:
            self.store.move(last, i)
            self._running[i] = self._running[last]
        self._running.pop()
        self.store.lengths[last] = 0
        return row

    def _finish(self, row: _Row, reason: str | None, error: BaseException | None = None) -> None:
        row.cache = None
        key = "failed" if error is not None else "cancelled" if reason == "cancelled" else "finished"
        self.counters[key] += 1
        row.request._end(reason, error)

    def _fail_all(self, error: BaseException) -> None:
        rows = list(self._waiting) + ([self._prefilling] if self._prefilling else []) + list(self._running)
        for request in self._inbox:
            self.counters["failed"] += 1
            request._end(None, error)
        self._waiting.clear()
        self._inbox.clear()
        self._prefilling = None
        while self._running:
            self._remove(len(self._running) - 1)
        for row in rows:
            if not row.request.done:
                self._finish(row, None, error)
