"""Greedy speculative decoding with the checkpoint's MTP layer (lm/mtp.py), one sequence at a time.

A step, with `next` the last picked token (not yet in the caches) and K drafts:
1. draft: the MTP layer takes the main model's hidden states of the tokens committed since the last
   step (each with the token after it) and drafts d1; for K > 1 it runs again on its own output
   and the token it drafted (vLLM's recursion over one layer), up to dK. Its positions beyond the
   committed tokens are dropped at once (`Cache.truncate`): the next step rewrites them from the
   main model's hidden states.
2. verify: one forward of the main model over [next, d1..dK] gives K + 1 pickings.
3. accept the longest prefix of drafts equal to the main model's own picks, plus the main model's
   pick after it: 1 to K + 1 new tokens per forward, the same tokens as greedy decoding without
   drafts (the picks go through the same `Sampler`, so penalties apply token by token).
4. rollback (`Cache.commit`): the verify forward kept each DeltaNet layer's state after every one of
   its tokens (lm/delta_rule.stepwise_gated_delta_rule) and the conv's inputs; the state after the
   last accepted token is copied back and the KV positions after it are zeroed. Cost per step: K
   copies of each DeltaNet recurrent state during the verify and one more on a rejection (float32
   [Hv, Dk, Dv]: 2 MiB a layer, 60 MiB for the 30 DeltaNet layers of the 35B-A3B), the verify's
   DeltaNet run token by token, and no weight read twice.

Greedy rows only (plain or with penalties), batch 1; stream_generate says once when it cannot apply.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from ..cache import Cache
from ..model import CausalLM
from ..sampling import Sampler, SamplingParams, argmax
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


def draft(lm: CausalLM, mtp_cache: Cache, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
          k: int, next_position: int) -> list[int]:  # fmt: skip
    """K greedy drafts after the token at `next_position`. embeds [1, T, H]: the embeddings of the T
    tokens committed since the last draft (the last one being the token at `next_position`);
    hidden [1, T, H]: the main model's hidden states of the tokens before each; positions [3, 1, T]
    their predecessors' positions. Leaves `mtp_cache` holding the committed positions only."""
    mtp, rotary = lm.mtp, lm.model.rotary_emb
    g = mtp(embeds, hidden, rotary(positions, embeds.dtype), mtp_cache)[:, -1:]  # [1, 1, H]
    committed = mtp_cache.length
    drafts = [argmax(lm.lm_head(g)[0, -1].float())]
    for j in range(1, k):
        pos = torch.full((3, 1, 1), next_position + j - 1, device=g.device)
        g = mtp(lm.embed(torch.tensor([[drafts[-1]]], device=g.device)), g, rotary(pos, g.dtype), mtp_cache)
        drafts.append(argmax(lm.lm_head(g)[0, -1].float()))
    mtp_cache.truncate(committed)
    return drafts


def generate_speculative(lm: CausalLM, input_ids: torch.Tensor, params: SamplingParams, *,
                         inputs_embeds: torch.Tensor | None, positions: torch.Tensor | None,
                         eos_token_ids: tuple[int, ...], prefill_chunk: int, max_len: int | None,
                         stop_when: Callable[[list[int]], bool] | None,
                         stats: SpeculativeStats) -> Iterator[tuple[int, str | None]]:  # fmt: skip
    """Greedy generation of one unpadded prompt (input_ids [1, T]; `inputs_embeds` [1, T, H] and
    mRoPE `positions` [3, 1, T] optional) drafting `lm.num_speculative_tokens` tokens per step;
    yields (token, finish reason or None)."""
    k, n = lm.num_speculative_tokens, input_ids.shape[1]
    length = max_len or n + params.max_new_tokens + k
    cache, mtp_cache = lm.make_cache(1, length), lm.mtp.make_cache(1, length)
    embeds = lm.embed(input_ids) if inputs_embeds is None else inputs_embeds
    if positions is None:
        positions = torch.arange(n, device=embeds.device)[None, None].expand(3, 1, n)
    hidden = torch.cat([lm.hidden_states(inputs_embeds=embeds[:, s : s + prefill_chunk],
                                         positions=positions[:, :, s : s + prefill_chunk], cache=cache)
                        for s in range(0, n, prefill_chunk)], dim=1)  # fmt: skip
    sampler, outputs = Sampler([params], [input_ids[0].tolist()], device=embeds.device), []
    token = sampler(lm.lm_head(hidden[:, -1]), [0], [outputs])[0]
    next_position = int(positions.amax()) + 1
    pending = (embeds[:, 1:], hidden, positions)  # the MTP layer's inputs; the new token's embedding joins below
    while True:
        outputs.append(token)
        reason = runner.finish_reason(outputs, params, eos_token_ids, stop_when)
        yield token, reason
        if reason is not None:
            return
        k_now = min(k, params.max_new_tokens - len(outputs) - 1)  # no drafts past max_new_tokens
        drafts = []
        if k_now > 0:
            embeds = torch.cat([pending[0], lm.embed(torch.tensor([[token]], device=hidden.device))], dim=1)
            drafts = draft(lm, mtp_cache, embeds, pending[1], pending[2], k_now, next_position)
            cache.begin_verify()
        ids = torch.tensor([[token, *drafts]], device=hidden.device)
        t = ids.shape[1]
        pos = torch.arange(next_position, next_position + t, device=ids.device)[None, None].expand(3, 1, t)
        hidden = lm.hidden_states(ids, positions=pos, cache=cache)  # [1, t, H]
        logits = lm.lm_head(hidden)[0]  # [t, V]
        new = []
        for j in range(t):
            new.append(sampler(logits[j : j + 1], [0], [outputs + new])[0])
            if j == len(drafts) or new[-1] != drafts[j]:
                break
        if drafts:
            cache.commit(len(new))
            stats.steps += 1
            stats.drafted += len(drafts)
            stats.accepted += len(new) - 1
        for token in new[:-1]:  # the accepted drafts; the last pick is yielded at the top of the loop
            outputs.append(token)
            reason = runner.finish_reason(outputs, params, eos_token_ids, stop_when)
            yield token, reason
            if reason is not None:
                return
        token = new[-1]  # (without drafts this step was the last one: the MTP layer is not needed again)
        accepted = torch.tensor([new[:-1]], dtype=torch.long, device=ids.device)
        pending = (lm.embed(accepted), hidden[:, : len(new)], pos[:, :, : len(new)])
        next_position += len(new)
