"""Gated DeltaNet token mixer: causal depthwise conv, then the gated delta rule with a recurrent state."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from . import kernels
from .cache import LinearSlot
from .config import TextConfig
from .delta_rule import chunked_gated_delta_rule, gated_delta_step, stepwise_gated_delta_rule
from .linear import Linear
from .norm import GatedRMSNorm


def causal_conv(x: torch.Tensor, window: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv + SiLU along time. x [B, T, C]; window [B, K-1, C] (the previous inputs);
    weight [C, K]. Returns (out [B, T, C], new window [B, K-1, C]).

    Computed as K shifted multiply-adds in the [B, T, C] layout of the projections: no transposes
    (on CPU in float32, in one pass: kernels/causal_conv.cpp).
    """
    if (fused := kernels.causal_conv(x, window, weight)) is not None:
        return fused[0], fused[1]
    t, kernel = x.shape[1], weight.shape[1]
    full = torch.cat([window, x], dim=1)  # [B, K-1+T, C]
    out = full[:, :t] * weight[:, 0]
    for j in range(1, kernel):
        out.addcmul_(full[:, j : j + t], weight[:, j])
    return F.silu(out), full[:, t:].clone()


class GatedDeltaNet(nn.Module):
    def __init__(self, config: TextConfig):
        super().__init__()
        self.num_k_heads, self.num_v_heads = config.linear_num_key_heads, config.linear_num_value_heads
        self.head_k_dim, self.head_v_dim = config.linear_key_head_dim, config.linear_value_head_dim
        self.key_dim = self.num_k_heads * self.head_k_dim
        self.value_dim = self.num_v_heads * self.head_v_dim
        conv_dim = 2 * self.key_dim + self.value_dim
        h = config.hidden_size
        self.in_proj_qkv = Linear(h, conv_dim, bias=False)  # [q | k | v]
        self.in_proj_z = Linear(h, self.value_dim, bias=False)
        self.in_proj_b = Linear(h, self.num_v_heads, bias=False)
        self.in_proj_a = Linear(h, self.num_v_heads, bias=False)
        kernel = config.linear_conv_kernel_dim
        self.conv1d = nn.Conv1d(conv_dim, conv_dim, kernel, groups=conv_dim, bias=False, padding=kernel - 1)
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(self.num_v_heads))
        self.norm = GatedRMSNorm(self.head_v_dim, eps=config.rms_norm_eps)
        self.out_proj = Linear(self.value_dim, h, bias=False)

    def forward(self, x: torch.Tensor, slot: LinearSlot, real: torch.Tensor | None) -> torch.Tensor:
        """x [B, T, hidden]; `real` [B, T] bool marks non-padding tokens (None: all real)."""
        b, t, _ = x.shape
        if real is not None:  # padding contributes nothing to the conv window or the state
            x = x * real[..., None].to(x.dtype)
        mixed = self.in_proj_qkv(x)  # [B, T, conv_dim]
        if slot.steps is not None:  # a verify forward: keep the conv's inputs for Cache.commit
            slot.conv_inputs = torch.cat([slot.conv, mixed], dim=1)
        qkv, slot.conv = causal_conv(mixed, slot.conv, self.conv1d.weight[:, 0])
        q, k, v = qkv.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = q.reshape(b, t, self.num_k_heads, self.head_k_dim)
        k = k.reshape(b, t, self.num_k_heads, self.head_k_dim)
        v = v.reshape(b, t, self.num_v_heads, self.head_v_dim)
        beta = self.in_proj_b(x).sigmoid()  # [B, T, Hv]
        g = -self.A_log.float().exp() * F.softplus(self.in_proj_a(x).float() + self.dt_bias)
        if real is not None:
            g, beta = g * real[..., None], beta * real[..., None]
        if slot.steps is not None:  # a verify forward: token by token, each prefix's state kept
            out, slot.recurrent = stepwise_gated_delta_rule(q, k, v, g, beta, slot.recurrent, slot.steps)
        else:
            rule = gated_delta_step if t == 1 else chunked_gated_delta_rule
            out, slot.recurrent = rule(q, k, v, g, beta, slot.recurrent)  # [B, T, Hv, Dv]
        z = self.in_proj_z(x).reshape(b, t, self.num_v_heads, self.head_v_dim)
        out = self.norm(out, z).reshape(b, t, self.value_dim)
        return self.out_proj(out)
