"""Interleaved multimodal rotary embedding (mRoPE) over a partial head dimension."""

import torch
from torch import nn

from .config import TextConfig


def mrope_axis_of_frequency(rotary_dim: int, mrope_section: tuple[int, int, int]) -> torch.Tensor:
    """Which position row (0 = t, 1 = h, 2 = w) drives each of the `rotary_dim // 2` frequencies.

    Interleaved layout: frequency `i` uses row h when `i % 3 == 1 and i < 3 * section[1]`, row w when
    `i % 3 == 2 and i < 3 * section[2]`, else row t (transformers' `recomposition_frequencies`).
    """
    axis = torch.zeros(rotary_dim // 2, dtype=torch.long)
    for row, offset in ((1, 1), (2, 2)):
        axis[offset : 3 * mrope_section[row] : 3] = row
    return axis


class MRotaryEmbedding(nn.Module):
    """Turns 3-row positions `[3, B, T]` into `cos, sin` of shape `[B, T, rotary_dim]`."""

    def __init__(self, config: TextConfig):
        super().__init__()
        dim = config.rotary_dim
        inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.register_buffer("axis", mrope_axis_of_frequency(dim, config.mrope_section), persistent=False)

    @torch.no_grad()
    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        pos = positions[self.axis].permute(1, 2, 0).float()  # [B, T, rotary_dim/2], each from its row
        freqs = pos * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)  # [B, T, rotary_dim]
        return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_partial_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first `cos.shape[-1]` dims of `x` [B, H, T, D]; `cos`/`sin` are [B, T, R]."""
    r = cos.shape[-1]
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # [B, 1, T, R]
    rot = x[..., :r]
    return torch.cat((rot * cos + rotate_half(rot) * sin, x[..., r:]), dim=-1)
