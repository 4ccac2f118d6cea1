"""The tower's matrices may be stored narrower than it computes (bf16 storage, float32 compute):
each is converted right where it is used, one at a time. bf16 -> fp32 is exact, so the outputs
equal those of a float32 tower holding the same (bf16) weights.

With the "bf16" compute format (`VisionModel.compute`, chosen at load) the products take bf16
inputs and weights with float32 sums (torch's bf16 GEMM: oneDNN, AMX or AVX512-BF16 where the CPU
has them) and give bf16 outputs, which the next product, attention (torch's SDPA, float32 softmax
and sums) or GELU takes as they are; the residual stream, the norms and the residual updates'
biases stay float32 (vision/fast.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def used(weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """A matrix in the compute dtype of `x`: itself, or a converted copy when it is stored narrower."""
    return weight.to(x.dtype)


class Linear(nn.Linear):
    """`nn.Linear` computing in its input's dtype whatever its weight's storage dtype."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, used(self.weight, x), self.bias)


def bf16_affine(x: torch.Tensor, linear: nn.Linear) -> torch.Tensor:
    """linear(x) for bf16 `x`: bf16 weight and bias, float32 sums, bf16 output."""
    b = linear.bias.to(torch.bfloat16) if linear.bias is not None else None
    return F.linear(x, linear.weight.to(torch.bfloat16), b)
