"""Speculative decoding in the serving engine: each row's MTP state, and one draft-and-verify step
of the running rows (the maths of each part is speculative.py's; this file places it on the slots).

With the model's MTP layer loaded, every row owns a `RowDrafts`: the MTP layer's KV cache of that
row (batch 1; one position per main-model position whose next token the layer has seen) and the
main model's final-normed hidden states of the tokens committed since (`pending`). Its prompt is
fed to the MTP layer chunk by chunk as it is prefilled, so a long prompt costs no MTP prefill
inside a decode step; prefix snapshots carry a copy (`Cache.drafts`), so a resumed prompt drafts
as well as a cold one. The MTP cache holds the row's whole length (prompt + max_new_tokens): one
full-attention layer's keys and values beside the slot's (4 KiB a token for the 35B-A3B in float32),
counted in the prefix cache's budget when a snapshot carries it.

One engine step of speculation (`verify_step`):
1. each row's MTP layer sees its pending states and the tokens after them (the last being the row's
   pick), then drafts k tokens (fewer near max_new_tokens), recursively; the LM head runs once per
   draft depth for all rows together. A row with a rule (a grammar, a thinking budget) that can
   roll back drafts under it: the rule is shown the drafts for their masks, then rolled back;
2. one verify of every running row's [pick, *drafts] through the decode plan on the slots
   (lm/decode.py verify_logits: each row at its own length; more than 8 tokens in calls of at most
   8), or, without the plan, row by row through the layers on a batch-1 view of the row's slot;
3. each row accepts as speculative.accept does (greedy: the longest prefix of drafts equal to its
   picks; sampled: speculative sampling), each position masked by the row's rule as a plain step's
   pick is, with its logprobs when asked; its slot keeps the accepted tokens' states (Cache.commit;
   a ragged row just counts them).
"""

from __future__ import annotations

import torch

from .. import decode
from ..cache import Cache, KVSlot, LinearSlot
from ..model import CausalLM
from ..sampling import argmax
from .slots import resumed, trimmed
from .speculative import SpeculativeStats, accept


class RowDrafts:
    """The MTP state of one engine row (see the module docstring)."""

    def __init__(self, cache: Cache, hidden: torch.Tensor, positions: torch.Tensor):
        self.cache = cache  # the MTP layer's KV cache, batch 1
        self.hidden = hidden  # [P, H] pending: main-model states of committed tokens the layer has not seen
        self.positions = positions  # [3, P] their positions

    @classmethod
    def new(cls, lm: CausalLM, max_len: int) -> "RowDrafts":
        h = lm.config.hidden_size
        device, dtype = lm.lm_head.weight.device, lm.compute_dtype
        return cls(lm.mtp.make_cache(1, max_len), torch.zeros(0, h, device=device, dtype=dtype),
                   torch.zeros(3, 0, dtype=torch.long, device=device))  # fmt: skip

    @property
    def pending(self) -> int:
        return self.hidden.shape[0]

    def nbytes(self) -> int:
        return self.cache.nbytes() + self.hidden.numel() * self.hidden.element_size()

    def snapshot(self) -> "RowDrafts":
        """A copy for a prefix snapshot (the pending tensors are never written in place: shared)."""
        return RowDrafts(trimmed(self.cache, copy=True), self.hidden, self.positions)

    def resumed(self, max_len: int) -> "RowDrafts":
        """A copy that can grow to `max_len` positions (a request resuming from a snapshot)."""
        return RowDrafts(resumed(self.cache, max_len), self.hidden, self.positions)

    def append(self, hidden: torch.Tensor, positions: torch.Tensor) -> None:
        """The states hidden [n, H] at positions [3, n] of n newly committed tokens join the pending."""
        self.hidden = torch.cat([self.hidden, hidden])
        self.positions = torch.cat([self.positions, positions], dim=1)

    def consume(self, lm: CausalLM, next_embeds: torch.Tensor) -> torch.Tensor:
        """Run the MTP layer over the first m pending states with next_embeds [m, H], the embeddings
        of the tokens after them, which leave the pending; the layer's output [m, H]."""
        m = next_embeds.shape[0]
        pos = self.positions[:, None, :m]
        g = lm.mtp(next_embeds[None], self.hidden[None, :m], lm.model.rotary_emb(pos, next_embeds.dtype), self.cache)
        self.hidden, self.positions = self.hidden[m:], self.positions[:, m:]
        return g[0]

    def see_prompt(self, lm: CausalLM, hidden: torch.Tensor, positions: torch.Tensor, embeds: torch.Tensor) -> None:
        """A prefilled chunk of the prompt: hidden [n, H] at positions [3, n], embeds [n, H] its
        tokens' input embeddings (the fused ones of an image prompt). The layer sees every pending
        state but the chunk's last, whose next token is not known yet."""
        self.append(hidden, positions)
        if (m := self.pending - 1) > 0:
            self.consume(lm, embeds[embeds.shape[0] - m :])

    def settle(self, lm: CausalLM, tokens: list[int]) -> None:
        """Before a snapshot of a finished generation whose last `pending` tokens are `tokens` (the
        last of them not in the cache): the layer sees every pending state but the last."""
        if self.pending > 1:
            self.consume(lm, lm.embed(torch.tensor([tokens[-self.pending : -1]], device=self.hidden.device))[0])


class Payoff:
    """Whether drafting pays here: every `EVERY`-th step of the drafting rows runs without drafts,
    and the engine compares the new tokens a second of the two kinds of steps (rows of either kind
    see the same batch). `speedup` is None until enough steps of both were timed."""

    EVERY, PLAIN_STEPS = 32, 4

    def __init__(self):
        self.steps = 0
        self.spec = [0.0, 0.0, 0]  # seconds, new tokens per drafting row, steps
        self.plain = [0.0, 0]  # seconds, steps

    def plain_now(self) -> bool:
        """Whether this step runs without drafts (a timed one)."""
        self.steps += 1
        return self.steps % self.EVERY == 0

    def record(self, seconds: float, tokens_per_row: float | None) -> None:
        """A step of `seconds`: with drafts (`tokens_per_row`: its drafting rows' mean new tokens), or
        without (None)."""
        if tokens_per_row is None:
            self.plain[0] += seconds
            self.plain[1] += 1
        else:
            self.spec[0] += seconds
            self.spec[1] += tokens_per_row
            self.spec[2] += 1

    @property
    def speedup(self) -> float | None:
        """Tokens a second with drafts / without, once PLAIN_STEPS steps without were timed."""
        if self.plain[1] < self.PLAIN_STEPS or not self.spec[2]:
            return None
        return (self.spec[1] / self.spec[0]) / (self.plain[1] / self.plain[0])


def draft_all(lm: CausalLM, drafts: list[RowDrafts], tokens: list[list[int]], positions: list[int], ks: list[int],
              pick) -> list[list[int]]:  # fmt: skip
    """Each row's ks[i] drafts (rows with k = 0 draft nothing). tokens[i]: the row's generated tokens
    so far (the last is its pick at positions[i], not in the caches); pick(i, logits [V]) -> token."""
    rows = [i for i, k in enumerate(ks) if k > 0]
    out: list[list[int]] = [[] for _ in ks]
    if not rows:
        return out
    device = lm.lm_head.weight.device
    committed = {i: drafts[i].cache.length + drafts[i].pending for i in rows}
    g = {}
    for i in rows:  # the pending states, each with the token after it (the last: the pick)
        d = drafts[i]
        g[i] = d.consume(lm, lm.embed(torch.tensor([tokens[i][-d.pending :]], device=device))[0])[-1:]
    for j in range(max(ks)):
        live = [i for i in rows if ks[i] > j]
        if j > 0:  # the layer again on its own output and the token it drafted (vLLM's recursion)
            for i in live:
                pos = torch.full((3, 1, 1), positions[i] + j - 1, device=device)
                d = drafts[i]
                x = lm.embed(torch.tensor([[out[i][-1]]], device=device))
                g[i] = lm.mtp(x, g[i][None], lm.model.rotary_emb(pos, x.dtype), d.cache)[0]
        logits = lm.lm_head(torch.cat([g[i] for i in live])).float()  # one head read for all rows
        for i, row in zip(live, logits):
            out[i].append(pick(i, row))
    for i in rows:
        drafts[i].cache.truncate(committed[i])
    return out


def verify_step(lm: CausalLM, view: Cache, rows: list, ks: list[int], totals: SpeculativeStats) -> list[tuple]:
    """One speculative step of the n running rows of the slots (`view`: their ragged cache); `rows`
    are the scheduler's (each with its `drafts`, `sampler`, `next_pos` and `request`: its tokens so
    far, the last one its pick at next_pos, not yet in the cache; its rule and params), ks[i] the
    drafts row i may make; each drafting row's counts go to its request's `speculative` and to
    `totals`. Per row: (its new tokens: 1 to ks[i] + 1, the accepted drafts and its own pick; the
    logits [V] the last one was picked from; with logprobs, each one's (log-probability, top ones),
    else None), or (None, the error, None) for a row whose rule failed (it alone ends)."""
    outputs = [r.request.tokens for r in rows]
    rules = [r.request.rule for r in rows]
    masks = [rule is not None and hasattr(rule, "rollback_to") and getattr(rule, "rewinds", True) for rule in rules]
    qs: list[list[torch.Tensor]] = [[] for _ in rows]
    so_far: list[list[int]] = [[] for _ in rows]

    def pick(i: int, logits: torch.Tensor) -> int:
        """A draft of row i: under its rule when it can be rolled back (the draft then fits the
        constraint, as its verify will require); greedy: the argmax, sampled: drawn from q."""
        if masks[i]:
            try:
                if (constraint := rules[i](outputs[i] + so_far[i])) is not None:
                    logits = constraint.apply(logits)
            except Exception:  # noqa: BLE001 - no draft fits: the row's verify says why (it alone fails)
                masks[i] = False
                rules[i].rollback_to(len(outputs[i]))
        sampler = rows[i].sampler
        if sampler.params[0].greedy:
            token = argmax(logits)
        else:
            qs[i].append(q := sampler.distribution(logits, 0, outputs[i] + so_far[i]))
            token = sampler.draw(q, 0)
        so_far[i].append(token)
        return token

    ks = [k if r.drafts.pending else 0 for k, r in zip(ks, rows)]
    made = [[] for _ in rows]
    try:
        made = draft_all(lm, [r.drafts for r in rows], outputs, [r.next_pos for r in rows], ks, pick)
    finally:  # the rules saw the drafts for their masks: back to the tokens so far
        for rule, masked, output in zip(rules, masks, outputs):
            if masked:
                rule.rollback_to(len(output))
    tokens = [[out[-1], *d] for out, d in zip(outputs, made)]
    positions = [r.next_pos for r in rows]
    verified = decode.verify_logits(lm, view, tokens, positions)
    caches = None
    if verified is None:
        hidden, logits, caches = _verify_rows(lm, view, tokens, positions)
    else:
        hidden, logits = verified
    results, at = [], 0
    for i, (row, t) in enumerate(zip(rows, tokens)):
        lps = [] if row.request.params.logprobs is not None else None
        try:
            new = accept(row.sampler, logits[at : at + len(t)], 0, outputs[i], made[i], qs[i], rules[i], lps)
        except Exception as error:  # noqa: BLE001 - e.g. a grammar that admits no token: this row alone
            results.append((None, error, None))
            at += len(t)
            continue
        results.append((new, logits[at + len(new) - 1], lps))
        if ks[i]:
            for stats in (row.request.speculative, totals):
                stats.steps += 1
                stats.drafted += ks[i]
                stats.accepted += len(new) - 1
        pos = torch.arange(positions[i], positions[i] + len(new), device=hidden.device)[None].expand(3, -1)
        row.drafts.append(hidden[at : at + len(new)], pos)
        at += len(t)
    kept = [1 if r[0] is None else len(r[0]) for r in results]
    if caches is None:
        view.commit(kept)
    else:
        for i, n in enumerate(kept):
            _commit_row(view, caches[i], i, n)
    return results


def _row_cache(view: Cache, row: int) -> Cache:
    """A batch-1 cache over slot `row` of a ragged view (views of the store: written in place)."""
    kv, linear = {}, {}
    for i, slot in view.slots.items():
        if isinstance(slot, KVSlot):
            kv[i] = (slot.k[row : row + 1], slot.v[row : row + 1])
        else:
            linear[i] = (slot.conv[row : row + 1], slot.recurrent[row : row + 1])
    return Cache.over(kv, linear, length=int(view.lengths[row]), max_len=view.max_len)


def _verify_rows(lm: CausalLM, view: Cache, tokens: list[list[int]], positions: list[int]
                 ) -> tuple[torch.Tensor, torch.Tensor, list[Cache]]:  # fmt: skip
    """The verify row by row through the layers (without the decode plan, e.g. off the CPU):
    each on a batch-1 cache over its slot, left open for `_commit_row`."""
    hidden, caches = [], []
    device = lm.lm_head.weight.device
    for i, (t, p) in enumerate(zip(tokens, positions)):
        caches.append(cache := _row_cache(view, i))
        cache.begin_verify()
        pos = torch.arange(p, p + len(t), device=device)[None, None].expand(3, 1, -1)
        hidden.append(lm.hidden_states(torch.tensor([t], device=device), positions=pos, cache=cache)[0])
    hidden = torch.cat(hidden)
    return hidden, lm.lm_head(hidden), caches


def _commit_row(view: Cache, cache: Cache, row: int, kept: int) -> None:
    """Keep `kept` tokens of row `row`'s verify through the layers (on `cache`, over its slot), its
    states back in the slot."""
    cache.commit(kept)
    for i, slot in cache.slots.items():
        if isinstance(slot, LinearSlot):  # the reference DeltaNet path may replace the tensors
            own = view.slots[i]
            for new, stored in ((slot.conv, own.conv[row : row + 1]), (slot.recurrent, own.recurrent[row : row + 1])):
                if new.data_ptr() != stored.data_ptr():
                    stored.copy_(new)
    view.lengths[row] += kept
    view.length = int(view.lengths.max())
