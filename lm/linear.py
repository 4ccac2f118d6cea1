"""`nn.Linear` whose forward takes the CPU decode kernel when it applies (names and weights unchanged)."""

import torch
from torch import nn

from . import kernels


class Linear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.linear(x, self.weight, self.bias)
