"""Synchronous batched generation: chunked prefill, then one decode step per token for all live rows.

Prompts of different lengths are left-padded into one batch. After the prompt, every row's next
position is one past the largest position of its prompt (for text that is the count of real
tokens; for mRoPE prompts it is `max position + 1`, the same as transformers' rope deltas). Rows
that finish are dropped from the batch and from the cache, so the others do not pay for them.
The prefill forward, the decode step and the finish rules are the serving engine's (runner.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from .. import kernels
from ..model import CausalLM
from ..sampling import Sampler, SamplingParams
from . import runner
from .config import EngineConfig
from .speculative import SpeculativeStats, generate_speculative


@dataclass(frozen=True)
class TokenEvent:
    """One generated token of batch row `row`; `finish_reason` is set on the row's last token."""

    row: int
    token: int
    finish_reason: str | None  # None, "stop" (EOS / stop token) or "length"


@torch.no_grad()
def stream_generate(
    lm: CausalLM,
    input_ids: torch.Tensor,
    params: SamplingParams | list[SamplingParams],
    *,
    attention_mask: torch.Tensor | None = None,
    inputs_embeds: torch.Tensor | None = None,
    positions: torch.Tensor | None = None,
    eos_token_ids: tuple[int, ...] = (),
    prefill_chunk: int = EngineConfig.prefill_chunk,
    max_len: int | None = None,
    stop_when: Callable[[int, list[int]], bool] | None = None,
    stats: SpeculativeStats | None = None,
) -> Iterator[TokenEvent]:
    """Generate for a left-padded batch `input_ids` [B, T]; yields tokens as they are sampled.

    `inputs_embeds` [B, T, hidden] replaces the token embeddings (e.g. with vision features fused in);
    `positions` [3, B, T] are the prompt's mRoPE positions (default: text positions).
    `stop_when(row, tokens)` may end a row early (e.g. on a stop string); it finishes with "stop".
    A model loaded with its MTP layer (`lm.num_speculative_tokens` > 0) decodes speculatively
    (speculative.py): greedy rows give the same tokens, sampled ones tokens of the same distribution
    (speculative sampling). `stats` then counts its drafts.
    """
    try:
        if any(p.constrained for p in _row_params(params, len(input_ids))):
            raise ValueError("json_schema, regex, grammar and thinking_budget are enforced by a rule: generate "
                             "through mm.Pipeline (mm/constraints.py)")  # fmt: skip
        if lm.num_speculative_tokens:
            yield from _speculative(lm, input_ids, params, attention_mask, inputs_embeds, positions, eos_token_ids,
                                    prefill_chunk, max_len, stop_when, SpeculativeStats() if stats is None else stats)
            return
        yield from _generate(lm, input_ids, params, attention_mask, inputs_embeds, positions, eos_token_ids,
                             prefill_chunk, max_len, stop_when)
    finally:  # the next generation may run on another thread (kernels.release_openmp_workers)
        kernels.release_openmp_workers()


def _generate(lm, input_ids, params, attention_mask, inputs_embeds, positions, eos_token_ids, prefill_chunk,
              max_len, stop_when) -> Iterator[TokenEvent]:
    b, t = input_ids.shape
    params = _row_params(params, b)
    mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
    prompts = [ids[m.bool()].tolist() for ids, m in zip(input_ids, mask)]
    cache = lm.make_cache(b, max_len or t + max(p.max_new_tokens for p in params))
    logits, next_pos = _prefill(lm, cache, input_ids, mask, inputs_embeds, positions, prefill_chunk)
    sampler = Sampler(params, prompts, device=logits.device)
    rows, outputs = list(range(b)), [[] for _ in range(b)]
    positions = next_pos.tolist()  # each live row's next position, as Python ints
    stops = [None if stop_when is None else (lambda tokens, row=row: stop_when(row, tokens)) for row in range(b)]
    while rows:
        tokens = sampler(logits, rows, outputs)
        alive = []
        for i, (row, token) in enumerate(zip(rows, tokens)):
            outputs[row].append(token)
            reason = runner.finish_reason(outputs[row], params[row], eos_token_ids, stops[row])
            yield TokenEvent(row, token, reason)
            if reason is None:
                alive.append(i)
        if not alive:
            return
        if len(alive) < len(rows):
            cache.keep(torch.tensor(alive, device=next_pos.device))
            rows = [rows[i] for i in alive]
            tokens = [tokens[i] for i in alive]
            positions = [positions[i] for i in alive]
        logits, _ = runner.decode(lm, cache, tokens, positions)
        positions = [p + 1 for p in positions]


def _row_params(params: SamplingParams | list[SamplingParams], b: int) -> list[SamplingParams]:
    """One SamplingParams per row of a batch of `b`: a list as given (checked), or one for all."""
    params = list(params) if isinstance(params, (list, tuple)) else [params] * b
    if len(params) != b:
        raise ValueError(f"{len(params)} SamplingParams for a batch of {b}")
    return params


def _speculative(lm, input_ids, params, attention_mask, inputs_embeds, positions, eos_token_ids, prefill_chunk,
                 max_len, stop_when, stats) -> Iterator[TokenEvent]:  # fmt: skip
    """The batch through speculative.generate_speculative."""
    params = _row_params(params, input_ids.shape[0])
    mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
    for row, token, reason in generate_speculative(
        lm, input_ids, params, attention_mask=mask, inputs_embeds=inputs_embeds, positions=positions,
        eos_token_ids=eos_token_ids, prefill_chunk=prefill_chunk, max_len=max_len, stop_when=stop_when,
        stats=stats,
    ):
        yield TokenEvent(row, token, reason)


def generate(lm: CausalLM, input_ids: torch.Tensor, params, **kwargs) -> list[list[int]]:
    """All new tokens per row (see `stream_generate` for the arguments)."""
    outputs: list[list[int]] = [[] for _ in range(input_ids.shape[0])]
    for event in stream_generate(lm, input_ids, params, **kwargs):
        outputs[event.row].append(event.token)
    return outputs


def _prefill(lm, cache, input_ids, mask, inputs_embeds, positions, chunk: int):
    """Run the prompt through the model in chunks; return last-token logits [B, V] and next positions [B]."""
    t = input_ids.shape[1]
    for start in range(0, t, chunk):
        end = min(start + chunk, t)
        pos = positions[:, :, start:end] if positions is not None else None
        embeds = inputs_embeds[:, start:end] if inputs_embeds is not None else None
        logits = runner.prefill(lm, cache, input_ids=input_ids[:, start:end] if embeds is None else None,
                                inputs_embeds=embeds, positions=pos, attention_mask=mask[:, start:end])
    if positions is None:
        next_pos = mask.long().sum(-1)
    else:
        next_pos = positions.masked_fill(~mask.bool()[None], 0).amax(dim=(0, 2)) + 1
    return logits, next_pos
