"""RMS norms of the Qwen3.5 decoder (computed in float32, as the reference does)."""

import torch
import torch.nn.functional as F
from torch import nn

from . import kernels


class RMSNorm(nn.Module):
    """Zero-centred RMSNorm: `y = x / rms(x) * (1 + w)`, computed in float32 (weights stored near 0)."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (fused := kernels.rms_norm(x, self.weight, self.eps, 1.0)) is not None:  # float32 on CPU: one pass
            return fused
        scale = 1.0 + self.weight.float()
        return F.rms_norm(x.float(), scale.shape, scale, self.eps).type_as(x)


class GatedRMSNorm(nn.Module):
    """Gated DeltaNet output norm: `y = w * (x / rms(x)) * silu(z)` (plain weight, init 1)."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        if (fused := kernels.gated_rms_norm(x, z, self.weight, self.eps)) is not None:  # float32 on CPU: one pass
            return fused
        dtype = x.dtype
        h = self.weight * F.rms_norm(x.float(), self.weight.shape, eps=self.eps).to(dtype)
        return (h * F.silu(z.float())).to(dtype)
