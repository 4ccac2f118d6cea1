"""Vision self-attention: full (non-causal) within each image or temporal frame group, never across.

Tokens of all images are packed along one axis. A frame group (h*w patches) is one attention
segment; a video of t groups is t segments. Consecutive segments of equal length (the frames of a
video, or same-sized images in a row) form a *run* and go through ONE `scaled_dot_product_attention`
call with the segments as its batch axis, so there is no Python loop per frame.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .linear import Linear
from .rotary import apply_rotary


@dataclass(frozen=True)
class Segments:
    """Attention segments of the packed token axis, grouped into runs of equal length.

    `runs[i] = (first token, number of segments, tokens per segment)`; runs cover the tokens in order.
    """

    runs: tuple[tuple[int, int, int], ...]

    @classmethod
    def from_lengths(cls, lengths: list[int]) -> Segments:
        """Group a list of consecutive segment lengths into runs of equal length."""
        runs: list[list[int]] = []
        start = 0
        for length in lengths:
            if runs and runs[-1][2] == length:
                runs[-1][1] += 1
            else:
                runs.append([start, 1, length])
            start += length
        return cls(tuple((s, c, n) for s, c, n in runs))

    @property
    def num_tokens(self) -> int:
        return sum(c * n for _, c, n in self.runs)


def segment_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segments: Segments,
                      attend=None) -> torch.Tensor:
    """Attention of packed `q, k, v [N, H, D]` (any strides) within each segment: returns `[N, H*D]`.
    `attend(q, k, v, scale)`, when given, takes the place of SDPA: [count, length, H, D] in and out."""
    n, heads, head_dim = q.shape
    outs = []
    for start, count, length in segments.runs:
        tokens = slice(start, start + count * length)
        if attend is not None:
            views = (t[tokens].view(count, length, heads, head_dim) for t in (q, k, v))
            outs.append(attend(*views, head_dim**-0.5).view(count * length, heads * head_dim))
            continue
        # [count*length, H, D] -> [count, H, length, D] (a view; SDPA reads the strides)
        q_r, k_r, v_r = (t[tokens].view(count, length, heads, head_dim).transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q_r, k_r, v_r)  # [count, H, length, D]
        outs.append(out.transpose(1, 2).reshape(count * length, heads * head_dim))
    return outs[0] if len(outs) == 1 else torch.cat(outs)


class VisionAttention(nn.Module):
    """Fused qkv projection, 2D rotary on q and k, segment attention, output projection."""

    def __init__(self, hidden_size: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = hidden_size // num_heads
        self.qkv = Linear(hidden_size, 3 * hidden_size, bias=True)
        self.proj = Linear(hidden_size, hidden_size, bias=True)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, segments: Segments) -> torch.Tensor:
        """`x [N, C]`, rotary `cos, sin [N, D/2]` -> `[N, C]`."""
        n = x.shape[0]
        qkv = self.qkv(x).view(n, 3, self.num_heads, self.head_dim)  # [N, 3, H, D]
        qk = apply_rotary(qkv[:, :2], cos, sin)  # [N, 2, H, D]
        out = segment_attention(qk[:, 0], qk[:, 1], qkv[:, 2], segments)  # [N, C]
        return self.proj(out)
