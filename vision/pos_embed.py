"""Learned square position grid, bilinearly resampled (align_corners=True) to each image's grid.

This reproduces `F.interpolate(grid, size=(h, w), mode="bilinear", align_corners=True)` as 4 taps
per patch, with the same float32 arithmetic as transformers' `get_vision_interpolation_indices_and_weights`:

    src    = index * (side - 1) / max(size - 1, 1)        (float32; endpoints map to 0 and side - 1)
    taps   = clamp(floor(src) + {0, 1}, 0, side - 1)
    weight = clamp(1 - |src - floor(src) - {0, 1}|, min=0)

and the 2D taps/weights are the outer products of the row and column ones. Patches come out in
2x2-merge-block order, like the patches themselves.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .rotary import merge_order_positions


def _axis_taps(index: torch.Tensor, size: int, side: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Two bilinear taps `[M, 2]` (long) into a `side`-long axis and their float32 weights `[M, 2]`."""
    src = index.to(torch.float32) * (side - 1) / max(size - 1, 1)
    floor = torch.floor(src)
    offsets = torch.arange(0, 2, device=index.device)
    taps = (floor.long()[:, None] + offsets).clamp(0, side - 1)
    distance = (src[:, None] - floor[:, None] - offsets).abs()
    return taps, (1 - distance).clamp(min=0)


def interpolation_taps(
    h: int, w: int, side: int, merge: int, device: torch.device | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gather indices `[h*w, 4]` into the flattened `side x side` table and float32 weights `[h*w, 4]`."""
    positions = merge_order_positions(h, w, merge, device)  # [h*w, 2] (row, col)
    h_taps, h_weights = _axis_taps(positions[:, 0], h, side)
    w_taps, w_weights = _axis_taps(positions[:, 1], w, side)
    indices = (h_taps[:, :, None] * side + w_taps[:, None, :]).reshape(-1, 4)
    weights = (h_weights[:, :, None] * w_weights[:, None, :]).reshape(-1, 4)
    return indices, weights


def resampled_pos_embed(table: torch.Tensor, h: int, w: int, merge: int) -> torch.Tensor:
    """Position embeddings `[h*w, C]` for one h x w frame, from the learned table `[side*side, C]`.

    Summed in float32 (the weights' dtype) and returned in the table's dtype.
    """
    side = math.isqrt(table.shape[0])
    indices, weights = interpolation_taps(h, w, side, merge, table.device)
    pos = (F.embedding(indices, table) * weights[:, :, None]).sum(1)  # [h*w, 4, C] -> [h*w, C]
    return pos.to(table.dtype)
