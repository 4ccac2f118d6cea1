"""Sparse MoE block: float32 softmax router, top-k renormalised, SwiGLU experts, gated shared expert."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from . import kernels
from .config import TextConfig
from .formats import format_in, stored
from .mlp import SwiGLU


class Experts(nn.Module):
    """All routed experts, stored fused as in the official checkpoints.

    gate_up_proj [E, 2I, H] (gate rows first, then up), down_proj [E, H, I].
    Tokens are grouped by expert, and only experts that received tokens are touched: one decode
    token reads K experts' weights, never all E. With `grouped=True` (the fast path, on CPU) each
    projection runs as one call for all experts: the decode kernel when every expert has few rows,
    else (float32) the prefill kernel, which also gathers the rows and sums the weighted outputs
    into the tokens (expert_mlp.cpp), else a grouped GEMM (`torch._grouped_mm`). The reference
    (`grouped=False`, and any other device until the grouped paths are tested there) loops
    `F.linear` over the experts that received tokens. All give the same result.
    The weights may be stored in any format of lm/formats (rows of H inputs for gate_up_proj, of I
    for down_proj); the decode and prefill kernels read them directly, the other paths convert
    each expert that received tokens to float32.
    """

    compute: str | None = None  # prefill's compute format (lm/kernels/compute.py); set at load

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, grouped: bool = True):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        self.grouped = grouped

    def forward(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x [N, H]; experts, weights [N, K] -> [N, H] = sum_k weights[:, k] * expert_k(x)."""
        n, top_k = experts.shape
        flat = experts.reshape(-1)
        order = torch.argsort(flat, stable=True)  # selections grouped by expert
        counts = torch.bincount(flat, minlength=self.gate_up_proj.shape[0])
        rows = order // top_k  # the token of each selection
        if self.grouped and x.device.type == "cpu" and int(counts.max()) > kernels.MAX_ROWS:
            fused = kernels.expert_mlp(x, stored(self, "gate_up_proj"), stored(self, "down_proj"), counts, rows,
                                       weights.reshape(-1)[order], self.compute)
            if fused is not None:  # prefill, float32: gather, experts and weighted sum in one call
                return fused
        xs = x[rows]  # [N*K, H], grouped by expert
        ys = self._fast(xs, counts) if self.grouped else self._reference(xs, counts)
        if n > 64:  # prefill: weight in place and add into the few token rows (no [N*K, H] buffer)
            ys *= weights.reshape(-1)[order, None]
            return torch.zeros_like(x).index_add_(0, rows, ys)
        per_choice = torch.empty_like(ys)  # decode: scatter-add with repeated rows is slow on CPU
        per_choice[order] = ys
        return torch.einsum("nkh,nk->nh", per_choice.view(n, top_k, -1), weights)

    def _fast(self, xs: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        compact = self.gate_up_proj.dtype != xs.dtype or self.down_proj.dtype != xs.dtype
        if xs.device.type != "cpu":  # the grouped paths are built and tested for CPU only
            return self._reference(xs, counts)
        hit = counts.nonzero().squeeze(-1).tolist()
        sizes = counts[hit].tolist()
        gate_up = kernels.grouped_linear(xs, stored(self, "gate_up_proj"), hit, sizes)
        if gate_up is not None:  # decode: few rows per expert, bandwidth-bound
            gate, up = gate_up.chunk(2, dim=-1)
            return kernels.grouped_linear(F.silu(gate) * up, stored(self, "down_proj"), hit, sizes)
        if compact:  # a grouped GEMM would need every expert in float32: only those with tokens
            return self._reference(xs, counts)
        offsets = counts.cumsum(0).to(torch.int32)  # end row of each expert's group
        gate, up = torch._grouped_mm(xs, self.gate_up_proj.transpose(1, 2), offs=offsets).chunk(2, dim=-1)
        return torch._grouped_mm(F.silu(gate) * up, self.down_proj.transpose(1, 2), offs=offsets)

    def _reference(self, xs: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        hit = counts.nonzero().squeeze(-1).tolist()
        ys = torch.empty_like(xs)
        h, inter = xs.shape[-1], self.gate_up_proj.shape[1] // 2
        gate_up_fmt, down_fmt = format_in(self, "gate_up_proj"), format_in(self, "down_proj")
        start = 0
        for e, size in zip(hit, counts[hit].tolist()):
            end = start + size
            gate_up = kernels.to_float((self.gate_up_proj[e], gate_up_fmt), h).to(xs.dtype)
            gate, up = F.linear(xs[start:end], gate_up).chunk(2, dim=-1)
            down = kernels.to_float((self.down_proj[e], down_fmt), inter).to(xs.dtype)
            ys[start:end] = F.linear(F.silu(gate) * up, down)
            start = end
        return ys


class Router(nn.Module):
    def __init__(self, num_experts: int, hidden_size: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.weight = nn.Parameter(torch.zeros(num_experts, hidden_size))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, H] -> (expert ids [N, K], weights [N, K] in x's dtype)."""
        probs = F.softmax(kernels.linear(x, stored(self)), dim=-1, dtype=torch.float32)  # [N, E]
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return experts, weights.to(x.dtype)


class SparseMoeBlock(nn.Module):
    def __init__(self, config: TextConfig):
        super().__init__()
        h = config.hidden_size
        self.gate = Router(config.num_experts, h, config.num_experts_per_tok)
        self.experts = Experts(config.num_experts, h, config.moe_intermediate_size)
        self.shared_expert = SwiGLU(h, config.shared_expert_intermediate_size)
        self.shared_expert_gate = nn.Linear(h, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])  # [N, H]
        fused = kernels.moe_decode(  # decode on CPU: the whole block in one call
            x, stored(self.gate), stored(self.experts, "gate_up_proj"), stored(self.experts, "down_proj"),
            self.gate.top_k, stored(self.shared_expert.gate_proj), stored(self.shared_expert.up_proj),
            stored(self.shared_expert.down_proj), self.shared_expert_gate.weight,
        ) if self.experts.grouped else None
        if fused is not None:
            return fused.view(shape)
        experts, weights = self.gate(x)
        out = self.experts(x, experts, weights)
        out += torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out.view(shape)
