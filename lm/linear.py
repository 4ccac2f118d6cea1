"""`nn.Linear` whose forward takes the CPU decode kernel when it applies (names and weights unchanged)."""

import torch
from torch import nn

from . import kernels


class Linear(nn.Linear):
    compute: str | None = None  # prefill products' compute format (lm/kernels/compute.py); set at load

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.linear(x, self.weight, self.bias, self.compute)
