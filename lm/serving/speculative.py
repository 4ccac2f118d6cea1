"""Speculative decoding with the checkpoint's MTP layer (lm/mtp.py), greedy or sampled.

A step, with `next` the last picked token (not yet in the caches) and K drafts:
1. draft: the MTP layer takes the main model's hidden states of the tokens committed since the last
   step (each with the token after it) and drafts d1; for K > 1 it runs again on its own output
   and the token it drafted (vLLM's recursion over one layer), up to dK. Its positions beyond the
   committed tokens are dropped at once (`Cache.truncate`): the next step rewrites them from the
   main model's hidden states.
2. verify: one forward of the main model over [next, d1..dK] gives K + 1 pickings; on CPU, with
   at most 8 rows, calls of the decode plan of up to 8 tokens (lm/decode.py verify_logits: the decode
   step's kernels over the rows' tokens, each sequence's chained), else the layers one by one.
3. accept. Greedy rows: the longest prefix of drafts equal to the main model's own picks, plus the
   main model's pick after it: 1 to K + 1 new tokens per forward, the same tokens as greedy
   decoding without drafts (the picks go through the same `Sampler`, so penalties apply token by
   token). The logits are the same maths; a forward of K + 1 tokens rounds differently from K + 1
   one-token steps (~1e-6 relative in float32), which could only turn an exact tie. Sampled rows
   (temperature > 0): each draft d_j was drawn from q_j, the row's sampling distribution over the
   MTP layer's logits (its temperature, top-k / top-p / min-p and penalties, `Sampler.distribution`);
   with p_j the same over the main model's logits, d_j is kept with probability
   min(1, p_j(d_j) / q_j(d_j)); the first one rejected is replaced by a token drawn from
   max(0, p_j - q_j), renormalised, and when all K are kept one more is drawn from p_{K+1}
   (`speculative_pick`: standard speculative sampling, whose tokens are distributed as p exactly).
   With a seed the tokens are reproducible, but not the same ones as without drafts: the generator
   is drawn from in another order.
4. rollback (`Cache.commit`): the verify kept each DeltaNet layer's window and state after every one
   of its tokens, and the state after the last accepted token becomes the cache's; the KV
   positions after it are zeroed. Either way (the decode plan's kernel, or through the layers
   lm/delta_rule.stepwise_gated_delta_rule) the verify steps the cache's state in place token by
   token, copying each state but the last, and commit copies one back on a rejection: float32
   [Hv, Dk, Dv], 2 MiB a layer, 60 MiB for the 30 DeltaNet layers of the 35B-A3B; nothing when
   every draft is kept. No weight is read twice either way.

Each row of a batch accepts its own drafts; the KV positions that one row rejected while another
accepted stay in it as masked holes, as left padding does. Constraints are the serving engine's
(lm/serving/drafts.py passes each row's rule to `accept`); stream_generate refuses them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from .. import decode
from ..cache import Cache
from ..model import CausalLM
from ..sampling import Sampler, SamplingParams, argmax, draw
from . import runner


@dataclass
class SpeculativeStats:
    """Counters of one or more speculative generations (`stream_generate(stats=...)`)."""

    steps: int = 0  # verify forwards of the main model
    drafted: int = 0  # tokens drafted by the MTP layer
    accepted: int = 0  # drafted tokens the main model agreed with

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_step(self) -> float:
        """New tokens per verify forward (accepted drafts plus the main model's own pick)."""
        return (self.accepted + self.steps) / self.steps if self.steps else 0.0


@dataclass
class _Rows:
    """The live rows of a speculative generation and what the MTP layer has not seen yet: the main
    model's hidden states of the tokens committed since the last draft, left-padded to one length."""

    ids: list[int]  # the rows' indices in the caller's batch
    tokens: list[int]  # each row's last pick, not yet in the caches
    next_positions: list[int]  # its position
    embeds: torch.Tensor  # [B, P-1, H] the embeddings of the tokens after the pending ones but the last
    hidden: torch.Tensor  # [B, P, H] the main model's final-normed hidden states
    positions: torch.Tensor  # [3, B, P] their positions
    mask: torch.Tensor  # [B, P] 0 on left padding


def draft(lm: CausalLM, mtp_cache: Cache, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
          mask: torch.Tensor, k: int, next_positions: list[int],
          pick: Callable[[int, torch.Tensor], int] | None = None) -> list[list[int]]:  # fmt: skip
    """Each row's k drafts after its token at `next_positions`, `pick(row index, logits [V])` each
    (default: the argmax). embeds [B, T, H]: the embeddings of the tokens committed since the last
    draft (the last one being the token at `next_positions`); hidden [B, T, H]: the main model's
    hidden states of the tokens before each; positions [3, B, T] those tokens' positions; mask
    [B, T] 0 on left padding. Leaves `mtp_cache` holding the committed positions only."""
    mtp, rotary = lm.mtp, lm.model.rotary_emb
    pick = pick or (lambda i, logits: argmax(logits))
    g = mtp(embeds, hidden, rotary(positions, embeds.dtype), mtp_cache, mask)[:, -1:]  # [B, 1, H]
    committed = mtp_cache.length
    drafts = [[pick(i, row) for i, row in enumerate(lm.lm_head(g[:, -1]).float())]]
    after = torch.tensor(next_positions, device=g.device)
    for j in range(1, k):
        pos = (after + j - 1)[None, :, None].expand(3, -1, 1)
        g = mtp(lm.embed(torch.tensor(drafts[-1], device=g.device)[:, None]), g, rotary(pos, g.dtype), mtp_cache)
        drafts.append([pick(i, row) for i, row in enumerate(lm.lm_head(g[:, -1]).float())])
    mtp_cache.truncate(committed)
    return [list(row) for row in zip(*drafts)]


def speculative_pick(p: torch.Tensor, q: torch.Tensor, drafted: int,
                     generator: torch.Generator | None = None) -> tuple[int, bool]:  # fmt: skip
    """One position of speculative sampling: `drafted` was drawn from q [V]; it is kept with
    probability min(1, p[d] / q[d]) (u q[d] < p[d] for u uniform in [0, 1)), else a token is drawn
    from max(0, p - q) renormalised. The token returned is distributed as p, whatever q is.
    Returns (token, kept)."""
    u = float(torch.rand((), dtype=torch.float64, generator=generator))
    if u * float(q[drafted]) < float(p[drafted]):
        return drafted, True
    residual = (p - q).clamp(min=0)
    if not bool(residual.sum() > 0):  # p <= q everywhere: only rounding rejects then; p is the law
        residual = p
    return draw(residual, generator), False


def generate_speculative(lm: CausalLM, input_ids: torch.Tensor, params: list[SamplingParams], *,
                         attention_mask: torch.Tensor, inputs_embeds: torch.Tensor | None,
                         positions: torch.Tensor | None, eos_token_ids: tuple[int, ...], prefill_chunk: int,
                         max_len: int | None, stop_when: Callable[[int, list[int]], bool] | None,
                         stats: SpeculativeStats) -> Iterator[tuple[int, int, str | None]]:  # fmt: skip
    """Generation of a left-padded batch (input_ids [B, T], attention_mask [B, T];
    `inputs_embeds` [B, T, H] and mRoPE `positions` [3, B, T] optional) drafting
    `lm.num_speculative_tokens` tokens per step; yields (row, token, finish reason or None). Each
    row accepts its own drafts; the KV positions a row rejected while another accepted stay in
    it as masked holes (Cache.commit), so a batch of several rows needs a cache of up to
    T + max_new_tokens * (K + 1) positions (one row: T + max_new_tokens + K)."""
    k, (b, n) = lm.num_speculative_tokens, input_ids.shape
    most = max(p.max_new_tokens for p in params)
    length = max_len or n + k + (most if b == 1 else most * (k + 1))
    cache, mtp_cache = lm.make_cache(b, length), lm.mtp.make_cache(b, length)
    embeds = lm.embed(input_ids) if inputs_embeds is None else inputs_embeds
    if positions is None:
        positions = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)[None].expand(3, -1, -1)
    hidden = torch.cat([lm.hidden_states(inputs_embeds=embeds[:, s : s + prefill_chunk],
                                         positions=positions[:, :, s : s + prefill_chunk],
                                         attention_mask=attention_mask[:, s : s + prefill_chunk], cache=cache)
                        for s in range(0, n, prefill_chunk)], dim=1)  # fmt: skip
    prompts = [ids[m.bool()].tolist() for ids, m in zip(input_ids, attention_mask)]
    sampler, outputs = Sampler(params, prompts, device=embeds.device), [[] for _ in range(b)]
    first = sampler(lm.lm_head(hidden[:, -1]), list(range(b)), outputs)
    after = positions.masked_fill(~attention_mask.bool()[None], 0).amax(dim=(0, 2)) + 1
    rows = _Rows(list(range(b)), first, after.tolist(), embeds[:, 1:], hidden, positions, attention_mask)
    news = [[token] for token in first]
    while True:
        alive = []
        for i, (row, new) in enumerate(zip(rows.ids, news)):
            for token in new:
                outputs[row].append(token)
                stop = None if stop_when is None else (lambda tokens, row=row: stop_when(row, tokens))
                reason = runner.finish_reason(outputs[row], params[row], eos_token_ids, stop)
                yield row, token, reason
                if reason is not None:
                    break
            else:
                alive.append(i)
        if not alive:
            return
        if len(alive) < len(rows.ids):
            _keep(rows, alive, cache, mtp_cache)
        left = min(params[row].max_new_tokens - len(outputs[row]) for row in rows.ids)
        news = _step(lm, cache, mtp_cache, rows, sampler, outputs, min(k, left - 1), stats)  # none past the end


def _step(lm: CausalLM, cache: Cache, mtp_cache: Cache, rows: _Rows, sampler: Sampler, outputs: list[list[int]],
          k: int, stats: SpeculativeStats) -> list[list[int]]:  # fmt: skip
    """One draft (k tokens; none when k = 0) and verify step; each row's new tokens."""
    device = rows.hidden.device
    drafts: list[list[int]] = [[] for _ in rows.ids]
    qs: list[list[torch.Tensor]] = [[] for _ in rows.ids]  # each sampled row's draft distributions
    if k > 0:

        so_far: list[list[int]] = [[] for _ in rows.ids]  # each row's drafts of this step, as they come

        def pick(i: int, logits: torch.Tensor) -> int:  # greedy rows: the argmax; sampled ones: drawn from q
            row = rows.ids[i]
            if sampler.params[row].greedy:
                token = argmax(logits)
            else:
                qs[i].append(q := sampler.distribution(logits, row, outputs[row] + so_far[i]))
                token = sampler.draw(q, row)
            so_far[i].append(token)
            return token

        embeds = torch.cat([rows.embeds, lm.embed(torch.tensor(rows.tokens, device=device)[:, None])], dim=1)
        drafts = draft(lm, mtp_cache, embeds, rows.hidden, rows.positions, rows.mask, k, rows.next_positions, pick)
        cache.begin_verify()
    tokens = [[token, *d] for token, d in zip(rows.tokens, drafts)]
    steps = torch.arange(k + 1, device=device)
    pos = (torch.tensor(rows.next_positions, device=device)[:, None] + steps)[None].expand(3, -1, -1)
    verified = decode.verify_logits(lm, cache, tokens, rows.next_positions) if k > 0 else None
    if verified is None:  # the layers one by one (no decode plan, or more than 8 rows)
        hidden = lm.hidden_states(torch.tensor(tokens, device=device), positions=pos, cache=cache)  # [B, k + 1, H]
        logits = lm.lm_head(hidden)  # [B, k + 1, V]
    else:  # one call of the decode plan's kernels (lm/decode.py)
        hidden, logits = (part.view(len(tokens), k + 1, -1) for part in verified)
    news = [accept(sampler, logits[i], row, outputs[row], drafts[i], qs[i]) for i, row in enumerate(rows.ids)]
    if k > 0:
        cache.commit([len(new) for new in news])
        stats.steps += 1
        stats.drafted += k * len(news)
        stats.accepted += sum(len(new) - 1 for new in news)
    _pending(lm, rows, news, hidden, pos)
    return news


def accept(sampler: Sampler, logits: torch.Tensor, row: int, output: list[int], drafts: list[int],
           qs: list[torch.Tensor], rule=None, logprobs: list | None = None) -> list[int]:  # fmt: skip
    """The main model's tokens from logits [k + 1, V] of [token, *drafts]: the accepted drafts, then
    a token of its own. Greedy: its picks up to the first that differs from the draft it verifies.
    Sampled (`qs`: the distributions the drafts were drawn from): speculative_pick per draft. A
    `rule` (the serving engine's constraint: tokens so far -> TokenRule or None) masks each
    position's logits as it would a plain step's, shown only the tokens accepted before it; with
    `logprobs` (a list) each token's (log-probability, top ones) is appended, as a plain step's."""
    new: list[int] = []
    greedy = sampler.params[row].greedy
    for j in range(len(drafts) + 1):
        scores = logits[j]
        if rule is not None and (constraint := rule(output + new)) is not None:
            scores = constraint.apply(scores)
        if greedy:
            token = sampler(scores[None], [row], {row: output + new})[0]
            kept = j < len(drafts) and token == drafts[j]
            if logprobs is not None:
                logprobs.append(sampler.logprobs[row])
        else:
            p = sampler.distribution(scores, row, output + new)
            if j < len(drafts):
                token, kept = speculative_pick(p, qs[j], drafts[j], sampler.generators[row])
            else:
                token, kept = sampler.draw(p, row), False
            if logprobs is not None:
                logprobs.append(sampler.logprobs_of(scores, row, output + new, token))
        new.append(token)
        if not kept:
            return new
    return new


def _pending(lm: CausalLM, rows: _Rows, news: list[list[int]], hidden: torch.Tensor, pos: torch.Tensor) -> None:
    """After a verify of [token, *drafts] (hidden [B, k + 1, H] at positions [3, B, k + 1]): each row's
    kept tokens become what the MTP layer sees next, right-aligned (left padding)."""
    b, p, device = len(news), max(len(new) for new in news), hidden.device
    rows.embeds = hidden.new_zeros(b, p - 1, hidden.shape[-1])
    rows.hidden = hidden.new_zeros(b, p, hidden.shape[-1])
    rows.positions = torch.zeros(3, b, p, dtype=pos.dtype, device=device)
    rows.mask = torch.zeros(b, p, dtype=torch.long, device=device)
    for i, new in enumerate(news):
        m = len(new)
        rows.hidden[i, p - m :], rows.positions[:, i, p - m :] = hidden[i, :m], pos[:, i, :m]
        rows.mask[i, p - m :] = 1
        if m > 1:
            rows.embeds[i, p - m :] = lm.embed(torch.tensor(new[:-1], device=device))
    rows.tokens = [new[-1] for new in news]
    rows.next_positions = [at + len(new) for at, new in zip(rows.next_positions, news)]


def _keep(rows: _Rows, alive: list[int], cache: Cache, mtp_cache: Cache) -> None:
    """Keep only the rows at indices `alive` (the others finished)."""
    index = torch.tensor(alive, device=rows.hidden.device)
    cache.keep(index)
    mtp_cache.keep(index)
    rows.ids, rows.tokens = [rows.ids[i] for i in alive], [rows.tokens[i] for i in alive]
    rows.next_positions = [rows.next_positions[i] for i in alive]
    rows.embeds, rows.hidden, rows.mask = rows.embeds[index], rows.hidden[index], rows.mask[index]
    rows.positions = rows.positions[:, index]
