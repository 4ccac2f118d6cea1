"""`nn.Linear` whose forward takes the CPU decode kernel when it applies (names and weights unchanged)."""

import torch
from torch import nn

from . import kernels
from .formats import Format, format_in


class Linear(nn.Linear):
    compute: str | None = None  # prefill products' compute format (lm/kernels/compute.py); set at load

    @property
    def fmt(self) -> Format:
        """The weight's storage format (lm/formats): its tag, given at load, or float32 / bf16 rows."""
        return format_in(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.linear(x, (self.weight, self.fmt), self.bias, self.compute)
