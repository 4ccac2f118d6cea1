"""Early fusion: vision embeddings replace the placeholder tokens' text embeddings."""

from __future__ import annotations

import torch


class PlaceholderMismatchError(ValueError):
    """The prompt's placeholder tokens and the vision features do not line up."""


def scatter_vision(
    embeds: torch.Tensor, input_ids: torch.Tensor, token_id: int, features: torch.Tensor, what: str
) -> torch.Tensor:
    """Write `features` [N, hidden] over the N positions of `token_id` in `input_ids` [B, T] (in order)."""
    mask = input_ids == token_id  # [B, T]
    count = int(mask.sum())
    if count != features.shape[0]:
        raise PlaceholderMismatchError(
            f"the prompt has {count} {what} placeholder tokens but the {what}s give {features.shape[0]} "
            "features; build prompts with mm.Processor so that placeholders are expanded to match"
        )
    embeds = embeds.clone()
    embeds[mask] = features.to(embeds.dtype)
    return embeds
