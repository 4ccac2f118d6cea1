"""Patch merger: LayerNorm per patch, then each 2x2 block of patches -> one LM-sized token."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .linear import Linear, bf16_affine


class PatchMerger(nn.Module):
    """`norm` over hidden (before the merge), view to `[-1, merge_unit * hidden]`, fc1, exact GELU, fc2."""

    def __init__(self, hidden_size: int, merge_unit: int, out_hidden_size: int, eps: float) -> None:
        super().__init__()
        self.merged_size = hidden_size * merge_unit
        self.norm = nn.LayerNorm(hidden_size, eps=eps)
        self.linear_fc1 = Linear(self.merged_size, self.merged_size, bias=True)
        self.linear_fc2 = Linear(self.merged_size, out_hidden_size, bias=True)

    def forward(self, x: torch.Tensor, compute: str = "fp32") -> torch.Tensor:
        """`x [N, C]` in merge-block order -> `[N / merge_unit, out_hidden_size]`; with `compute` "bf16"
        (and float32 x) fc1 and GELU in bf16 (vision/linear.py), fc2 in float32 on their output, so
        that the features are not rounded to bf16."""
        x = self.norm(x).view(-1, self.merged_size)  # [N/4, 4C]
        if compute == "bf16" and x.dtype == torch.float32:
            return self.linear_fc2(F.gelu(bf16_affine(x.to(torch.bfloat16), self.linear_fc1)).float())
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))
