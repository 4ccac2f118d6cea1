"""Dense SwiGLU MLP (the dense models' MLP and the MoE's shared expert)."""

import torch
import torch.nn.functional as F
from torch import nn

from . import kernels
from .formats import stored
from .linear import Linear


class SwiGLU(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fused = kernels.multi_linear(x, [stored(self.gate_proj), stored(self.up_proj)])  # CPU decode rows
        gate, up = fused if fused is not None else (self.gate_proj(x), self.up_proj(x))
        return self.down_proj(F.silu(gate) * up)
