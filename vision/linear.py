"""The tower's matrices may be stored narrower than it computes (bf16 storage, float32 compute):
each is converted right where it is used, one at a time. bf16 -> fp32 is exact, so the outputs
equal those of a float32 tower holding the same (bf16) weights."""

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
