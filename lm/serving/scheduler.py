"""The serving engine's scheduler: which rows decode and which prompt prefills at each step, within
the step's token budget, and what the prefix cache keeps (the policy of lm/serving/__init__.py).

It runs on the engine thread only. Requests enter through `admit` and leave through `Request._end`;
a fault of one request fails that request alone (`_guard`). The forward passes and the finish
rules are the generation core's (runner.py); the rows' states live in the slots (slots.py).
"""

from __future__ import annotations

import sys
import time
from collections import deque
from collections.abc import Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from ..kernels.compute import say_once
from ..model import CausalLM
from ..sampling import Sampler
from . import runner
from .config import EngineConfig, available_bytes, ram_bytes
from .drafts import Payoff, RowDrafts, verify_step
from .prefix_cache import PrefixCache
from .request import Prompt, Request
from .speculative import SpeculativeStats
from .slots import SlotStore, resumed, row_state, trimmed


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
    drafts: RowDrafts | None = None  # its MTP state, when it decodes speculatively (drafts.py)
    exact_end: bool = True  # whether its slot holds exactly its tokens but the last (not so when it
    # ended inside a run of accepted drafts: then no snapshot is taken of its generation)


def prefix_budget(config: EngineConfig) -> int:
    """The prefix cache's budget (EngineConfig.cache_bytes, as the memory stands once the weights are
    loaded); said once when the memory left cuts the default."""
    budget = config.cache_bytes()
    if config.prefix_cache_bytes is None and budget < min(2 << 30, ram_bytes() // 8):
        say_once("prefix-cache-small", f"{available_bytes() / 2**30:.1f} of {ram_bytes() / 2**30:.1f} GiB of RAM are "
                 f"available: the prefix cache gets {budget / 2**20:.0f} MiB (default: 2 GiB or an eighth of the RAM, "
                 "leaving 4 GiB for a long prompt's activations; --prefix-cache-mb to choose)")
    return budget


class Scheduler:
    def __init__(self, lm: CausalLM, eos: tuple[int, ...], config: EngineConfig):
        self.lm, self.eos, self.config = lm, eos, config
        self.max_len = config.slot_length(lm.config.max_position_embeddings)
        device = lm.lm_head.weight.device
        self.store = SlotStore(lm.config, config.max_batch, self.max_len, device=device, dtype=lm.compute_dtype)
        self.prefix = PrefixCache(prefix_budget(config))
        self.counters = dict(steps=0, decode_tokens=0, prefill_tokens=0, grouped_prefills=0, submitted=0, finished=0,
                             cancelled=0, failed=0, verify_steps=0, drafted=0, accepted=0)  # fmt: skip
        self._waiting: deque[_Row] = deque()
        self._prefilling: _Row | None = None
        self._running: list[_Row] = []  # row i lives in slot i
        self.payoff = Payoff()  # whether the MTP layer's drafts pay, measured (drafts.py)
        self.drafting = SpeculativeStats()  # every request's drafts (counters: verify_steps, drafted, accepted)

    def stats(self) -> dict:
        return dict(self.counters, running=len(self._running), waiting=len(self._waiting),
                    prefilling=int(self._prefilling is not None), slot_bytes=self.store.nbytes(),
                    slot_max_bytes=self.store.max_bytes(), prefix=self.prefix.stats(),
                    speculative_speedup=self.payoff.speedup)  # fmt: skip

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

    def admit(self, request: Request) -> None:
        """Queue a submitted request behind the waiting ones (a malformed one fails alone)."""
        with self._guard(request):
            self._waiting.append(self._admit_row(request))

    @property
    def busy(self) -> bool:
        """Whether any request waits, prefills or decodes."""
        return bool(self._waiting or self._prefilling or self._running)

    def _admit_row(self, request: Request) -> _Row:
        p = request.prompt
        t = len(p.token_ids)
        key = tuple(p.key) if p.key is not None else tuple(p.token_ids)
        every = self.config.snapshot_every
        stops = sorted(self._named_stops(p.snapshot_at, t) | set(range(every, t, every)) | {t})
        sampler = Sampler([request.params], [list(p.token_ids)], device=self.store.device)
        return _Row(request, sampler, key, stops, next_pos=p.next_position if p.next_position is not None else t)

    def _named_stops(self, points: Sequence[int], t: int) -> set[int]:
        """The caller's snapshot points inside a prompt of `t` tokens, at most `named_snapshots`: the
        first (after a shared system prompt) and the last ones (where the next chat turn leaves)."""
        points = sorted({s for s in points if 0 < s < t})
        most = self.config.named_snapshots
        if len(points) > most:
            points = points[:1] + points[len(points) - most + 1 :]
        return set(points)

    def _snapshot(self, key: tuple, cache, logits: torch.Tensor, drafts: RowDrafts | None) -> None:
        """Store a copy of a batch-1 cache's state (len(key) positions; with the row's MTP state, if
        it drafts) in the prefix cache, unless the copy alone would exceed its whole budget: then it
        is never made."""
        size = len(key) * (self.store.kv_bytes_per_token() + 1) + self.store.state_bytes()  # + 1: the key mask
        if drafts is not None:
            size += drafts.nbytes()
        if size + logits.numel() * logits.element_size() <= self.prefix.max_bytes:
            self.prefix.insert(key, _with_drafts(trimmed(cache, copy=True), drafts), logits)

    def step(self) -> None:
        """One engine step: drop cancelled requests, decode every running row, spend the rest of the
        token budget on prefill (see lm/serving/__init__.py)."""
        self.counters["steps"] += 1
        self._drop_cancelled()
        decoding = len(self._running)
        if decoding:
            self._decode()
        budget = max(1, self.config.step_tokens - decoding) if decoding else self.config.prefill_chunk
        while budget > 0:
            if self._prefilling is None:
                if not self._waiting or len(self._running) >= self.config.max_batch:
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
        row.drafts = self._row_drafts(row, None if snap is None else snap.state.drafts)
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
            fits = len(self._running) + len(group) < self.config.max_batch and (len(group) + 1) * max(longest, t) <= budget
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
            if not self.lm.num_speculative_tokens:
                logits = runner.prefill(self.lm, cache, inputs_embeds=embeds, attention_mask=mask)
            else:  # the rows' MTP layers see their prompts too
                hidden = self.lm.hidden_states(inputs_embeds=embeds, attention_mask=mask, cache=cache)
                logits = self.lm.lm_head(hidden[:, -1])
                for i in live:
                    row, t = group[i], len(group[i].key)
                    with self._guard(row.request, row):
                        row.drafts = self._row_drafts(row, None)
                        at = torch.arange(t, device=hidden.device)[None].expand(3, -1)
                        row.drafts.see_prompt(self.lm, hidden[i, width - t :], at, embeds[i, width - t :])
        except Exception as error:  # noqa: BLE001 - the group's requests fail, the engine goes on
            for i in live:
                self._fail(group[i].request, error, group[i])
            return b * width
        self.counters["prefill_tokens"] += int(mask.sum())
        self.counters["grouped_prefills"] += 1
        for i in live:
            row, t = group[i], len(group[i].key)
            if row.request.done:
                continue
            with self._guard(row.request, row):
                state = row_state(cache, i, width - t)
                self._snapshot(row.key, state, logits[i], row.drafts)
                row.done, row.logits = t, logits[i]
                self._begin_decoding(row, state)
        return b * width

    def _prefill(self, row: _Row, budget: int) -> int:
        """One chunk of the row's prompt (ending at the next snapshot point); returns its tokens."""
        p, start = row.request.prompt, row.done
        end = min(start + budget, next(s for s in row.stops if s > start))
        positions = p.positions[:, None, start:end] if p.positions is not None else None
        embeds = self._embeds(p, start, end)
        if row.drafts is None:
            logits = runner.prefill(self.lm, row.cache, inputs_embeds=embeds, positions=positions)[0]
        else:  # the MTP layer sees the chunk too
            hidden = self.lm.hidden_states(inputs_embeds=embeds, positions=positions, cache=row.cache)[0]
            logits = self.lm.lm_head(hidden[-1])
            at = torch.arange(start, end, device=hidden.device)[None].expand(3, -1) if positions is None else positions[:, 0]
            row.drafts.see_prompt(self.lm, hidden, at, embeds[0])
        row.done, row.logits = end, logits
        self.counters["prefill_tokens"] += end - start
        t = len(row.key)
        if end < t:
            if end in row.stops:
                self._snapshot(row.key[:end], row.cache, logits, row.drafts)
            return end - start
        self.prefix.insert(row.key, _with_drafts(trimmed(row.cache, copy=False), row.drafts), logits)
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
        if any(r.drafts is not None for r in self._running):
            return self._decode_speculative()
        n, running = len(self._running), self._running
        lengths = self.store.lengths[:n].tolist()  # each row's positions in the cache
        self.store.ensure(max(lengths) + 1)
        view = self.store.view(n, max(lengths))
        tokens, positions = [r.request.tokens[-1] for r in running], [r.next_pos for r in running]
        try:  # the decode plan updates the view's states in place; the model may replace them
            logits, ran_model = runner.decode(self.lm, view, tokens, positions, lengths)
            if ran_model:
                self.store.sync(view, n)
        except Exception as error:  # noqa: BLE001 - the rows' states are unknown now: they fail, the rest go on
            return self._fail_running(error)
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
        self._end_rows(ended)

    def _say_payoff(self) -> None:
        """Say once when drafting, measured over at least 4 x Payoff.EVERY steps, makes decoding slower."""
        speedup, c = self.payoff.speedup, self.counters
        if speedup is not None and speedup < 1 and self.payoff.steps >= 4 * Payoff.EVERY:
            rate = c["accepted"] / max(1, c["drafted"])
            say_once("speculative-slower", f"speculative decoding runs at {speedup:.2f}x the speed of decoding "
                     f"without drafts here: {rate:.0%} of the MTP layer's drafts are accepted, too few to pay "
                     "for drafting and verifying (docs/benchmarks.md has where it pays); consider turning it off")

    def _fail_running(self, error: BaseException) -> None:
        """A decode step failed: every running row's state is unknown, so each fails."""
        while self._running:
            row = self._remove(len(self._running) - 1)
            self._fail(row.request, error, row)

    def _end_rows(self, ended: list[int]) -> None:
        """Free the slots of the running rows at indices `ended` (whose request is over), after a
        snapshot of each finished generation."""
        for i in sorted(set(ended), reverse=True):
            row = self._running[i]
            if row.request.done:
                self._remove(i)
                continue
            self._snapshot_generation(i, row)
            self._finish(self._remove(i), row.reason)

    def _snapshot_generation(self, i: int, row: _Row) -> None:
        """At the end of running row i's generation, a snapshot of its slot (prompt and generated
        tokens but the last) for the next turn of a chat (EngineConfig.snapshot_generations)."""
        tokens = row.request.tokens
        if not (self.config.snapshot_generations and self.prefix.max_bytes and len(tokens) >= 2 and row.exact_end):
            return
        if row.drafts is not None:
            with self._guard(row.request, row):
                row.drafts.settle(self.lm, tokens)
        self.prefix.insert(row.key + tuple(tokens[:-1]), _with_drafts(self.store.save(i), row.drafts), row.logits)

    def _row_drafts(self, row: _Row, stored: RowDrafts | None) -> RowDrafts | None:
        """The row's MTP state when the model has its MTP layer (every row drafts then): a copy of a
        snapshot's, else a fresh one (a snapshot made without one: the layer then sees the prompt
        from where the prefill resumes)."""
        if not self.lm.num_speculative_tokens:
            return None
        size = len(row.key) + row.request.params.max_new_tokens + self.lm.num_speculative_tokens + 1
        return stored.resumed(size) if stored is not None else RowDrafts.new(self.lm, size)

    def _decode_speculative(self) -> None:
        """One decode step with drafts (drafts.py): every running row verifies its pick and the
        drafts of its MTP layer in one forward; each emits its accepted tokens."""
        n, running, k = len(self._running), self._running, self.lm.num_speculative_tokens
        k = 0 if self.payoff.plain_now() else k
        lengths = self.store.lengths[:n].tolist()
        ks = [min(k, r.request.params.max_new_tokens - len(r.request.tokens) - 1) for r in running]
        self.store.ensure(max(length + d + 1 for length, d in zip(lengths, ks)))
        view = self.store.view(n, max(lengths))
        start = time.perf_counter()
        try:
            results = verify_step(self.lm, view, running, ks, self.drafting)
        except Exception as error:  # noqa: BLE001 - the rows' states are unknown now: they fail, the rest go on
            return self._fail_running(error)
        totals = self.drafting
        self.counters.update(verify_steps=totals.steps, drafted=totals.drafted, accepted=totals.accepted)
        made = [len(new) for new, _, _ in results if new is not None]
        self.payoff.record(time.perf_counter() - start, sum(made) / len(made) if k and made else None)
        self._say_payoff()
        ended = []
        for i, (row, (new, logits, logprobs)) in enumerate(zip(running, results)):
            if new is None:  # its rule failed: `logits` holds the error
                self._fail(row.request, logits, row)
                ended.append(i)
                continue
            with self._guard(row.request, row):
                for j, token in enumerate(new):
                    row.next_pos += 1
                    self.counters["decode_tokens"] += 1
                    logprob = None if logprobs is None else logprobs[j]
                    if self._sample(row, logits, finish=False, token=token, logprob=logprob) is not None:
                        row.exact_end = j == len(new) - 1
                        ended.append(i)
                        break
            if row.request.done:  # its sampling failed
                ended.append(i)
        self._end_rows(ended)

    def _sample(self, row: _Row, logits: torch.Tensor, finish: bool = True, token: int | None = None,
                logprob: tuple | None = None) -> str | None:  # fmt: skip
        """Sample (unless `token`, the row's pick, is given, with its `logprob` record when the
        request asks for them) and emit one token; returns the finish reason when it ends the
        request (finished at once unless `finish` is False: then the caller frees the slot first)."""
        request = row.request
        row.logits = logits
        if token is None:
            if request.rule is not None and (rule := request.rule(request.tokens)) is not None:
                logits = rule.apply(logits)
            token = row.sampler(logits[None], [0], [request.tokens])[0]
        if request.params.logprobs is not None:  # before the token: a reader sees both
            request.logprobs.append(row.sampler.logprobs[0] if logprob is None else logprob)
        request._token(token)
        reason = runner.finish_reason(request.tokens, request.params, self.eos, request.stop_when)
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

    def fail_all(self, error: BaseException) -> None:
        """End every request in the scheduler (queued, prefilling, running) with `error`."""
        rows = list(self._waiting) + ([self._prefilling] if self._prefilling else []) + list(self._running)
        self._waiting.clear()
        self._prefilling = None
        while self._running:
            self._remove(len(self._running) - 1)
        for row in rows:
            if not row.request.done:
                self._finish(row, None, error)


def _with_drafts(state, drafts: RowDrafts | None):
    """A snapshot's state with a copy of the row's MTP state (drafts.py), if it drafts."""
    state.drafts = None if drafts is None else drafts.snapshot()
    return state
