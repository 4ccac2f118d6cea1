"""The generation core: a prefill forward, one decode step, and the rules that end a sequence.

Both ways of generating run these: the serving engine (engine.py, scheduler.py) on the slots of
many requests, each row at its own length, and `stream_generate` (generate.py) synchronously on one
left-padded batch. So the decode fallback (the CPU decode plan, else the model) and the finish
reasons are written once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from ..decode import step_tokens
from ..model import CausalLM
from ..sampling import SamplingParams


def prefill(lm: CausalLM, cache, *, input_ids: torch.Tensor | None = None, inputs_embeds: torch.Tensor | None = None,
            positions: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """One prefill forward of a chunk into `cache`; the logits of each row's last position [B, vocab]."""
    return lm(input_ids, inputs_embeds=inputs_embeds, positions=positions, attention_mask=attention_mask,
              cache=cache, last_only=True)[:, -1]  # fmt: skip


def decode(lm: CausalLM, cache, tokens: list[int], positions: list[int], lengths: list[int] | None = None
           ) -> tuple[torch.Tensor, bool]:  # fmt: skip
    """One decode step of every row of `cache`: row i's token `tokens[i]` at `positions[i]` (all three
    mRoPE axes). Through the CPU decode plan's one call from Python ints (lm/decode.py), once the
    model's first step on this cache has made it, else through the model. Returns the logits
    [B, vocab] and whether the model ran (then a caller holding states elsewhere syncs them)."""
    logits = step_tokens(cache, tokens, positions, lengths)
    if logits is not None:
        return logits, False
    device = lm.lm_head.weight.device
    ids = torch.tensor([[token] for token in tokens], device=device)
    pos = torch.tensor(positions, device=device)[None, :, None].expand(3, len(tokens), 1)
    return lm(ids, positions=pos, cache=cache)[:, -1], True


def finish_reason(tokens: list[int], params: SamplingParams, eos: Sequence[int],
                  stop_when: Callable[[list[int]], bool] | None = None) -> str | None:  # fmt: skip
    """Why a sequence whose generated tokens are `tokens` ends now: "stop" (an EOS or stop token,
    or `stop_when(tokens)`, e.g. a stop string), "length" (max_new_tokens reached), or None."""
    token = tokens[-1]
    if token in eos or token in params.stop_token_ids:
        return "stop"
    if len(tokens) >= params.max_new_tokens:
        return "length"
    if stop_when is not None and stop_when(tokens):
        return "stop"
    return None
