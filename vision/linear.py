"""The tower's matrices may be stored narrower than it computes (bf16 storage, float32 compute):
each is converted right where it is used, one at a time. bf16 -> fp32 is exact, so the outputs
equal those of a float32 tower holding the same (bf16) weights.

With the "bf16" compute format (`VisionModel.compute`, chosen at load) the products take bf16
inputs and weights with float32 sums (torch's bf16 GEMM: oneDNN, AMX or AVX512-BF16 where the CPU
has them) and give float32 outputs; attention takes bf16 queries, keys and values (torch's SDPA,
float32 softmax and sums); the residual stream and norms stay float32."""

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


def product(x: torch.Tensor, weight: torch.Tensor, compute: str) -> torch.Tensor:
    """x [N, K] times weight [M, K]^T -> [N, M] in x's dtype; in bf16 (rounded inputs and weights,
    float32 sums) when `compute` is "bf16" and x is float32."""
    if compute == "bf16" and x.dtype == torch.float32:
        return F.linear(x.to(torch.bfloat16), weight.to(torch.bfloat16)).float()
    return F.linear(x, used(weight, x))
