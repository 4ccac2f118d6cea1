"""2D (h, w) rotary embedding of the vision tower.

Each head dim D is split as [h-freqs, w-freqs, h-freqs, w-freqs] (D/4 each), i.e. the reference's
`cat([cat([cos_h, cos_w]), cat([cos_h, cos_w])])`. Because the two halves of cos and sin are equal,
we keep only the first half `[N, D/2]` and rotate with

    out[:D/2] = x1 * cos - x2 * sin,    out[D/2:] = x2 * cos + x1 * sin

which is `x * cos + rotate_half(x) * sin` written without the concatenations. Everything is float32.
"""

from __future__ import annotations

import torch


def inv_freq(head_dim: int, theta: float) -> torch.Tensor:
    """Inverse frequencies `[D/4]` shared by the h and w axes: theta ** (-arange(0, D/2, 2) / (D/2))."""
    spatial_dim = head_dim // 2
    return 1.0 / (theta ** (torch.arange(0, spatial_dim, 2, dtype=torch.float) / spatial_dim))


def merge_order_positions(h: int, w: int, merge: int, device: torch.device | None = None) -> torch.Tensor:
    """(row, col) of every patch of an h x w grid, in 2x2-merge-block order: `[h*w, 2]` long.

    Patches are emitted block-row, block-col, then row and col inside the merge block, which is
    the order the preprocessor flattens patches in (and the reference's `get_vision_position_ids`).
    """
    rows = torch.arange(h, device=device).view(h // merge, merge, 1, 1).expand(-1, -1, w // merge, merge)
    cols = torch.arange(w, device=device).view(1, 1, w // merge, merge).expand(h // merge, merge, -1, -1)
    # [h/m, m, w/m, m] -> [h/m, w/m, m, m]
    return torch.stack([rows.transpose(1, 2).flatten(), cols.transpose(1, 2).flatten()], dim=-1)


def rotary_cos_sin(positions: torch.Tensor, freqs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin `[N, D/2]` (float32) for positions `[N, 2]` (row, col): the half `[h-freqs, w-freqs]`."""
    angles = positions[..., None].float() * freqs.to(device=positions.device, dtype=torch.float)  # [N, 2, D/4]
    angles = angles.flatten(1)  # [N, D/2]: h freqs then w freqs
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate `x [N, ..., D]` by cos/sin `[N, D/2]`; computed in float32, returned in x's dtype.

    Returns a new contiguous tensor (x may be a strided view into the fused qkv projection).
    """
    half = x.shape[-1] // 2
    xf = x.float()
    x1, x2 = xf[..., :half], xf[..., half:]
    bshape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (half,)
    cos, sin = cos.view(bshape), sin.view(bshape)  # [N, 1.., D/2]
    out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)  # [N, ..., D]
    return out.to(x.dtype)
