"""One decoder layer: a token mixer (Gated DeltaNet or gated attention) and an MLP (MoE or dense)."""

from __future__ import annotations

import torch
from torch import nn

from .attention import GatedAttention
from .cache import KVSlot, LinearSlot
from .config import TextConfig
from .gated_deltanet import GatedDeltaNet
from .mlp import SwiGLU
from .moe import SparseMoeBlock
from .norm import RMSNorm


class DecoderLayer(nn.Module):
    def __init__(self, config: TextConfig, layer_idx: int):
        super().__init__()
        self.layer_type = config.layer_types[layer_idx]
        if self.layer_type == "linear_attention":
            self.linear_attn = GatedDeltaNet(config)
        else:
            self.self_attn = GatedAttention(config)
        if config.is_moe:
            self.mlp = SparseMoeBlock(config)
        else:
            self.mlp = SwiGLU(config.hidden_size, config.intermediate_size)
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        slot: KVSlot | LinearSlot,
        rope: tuple[torch.Tensor, torch.Tensor],
        attn_mask: torch.Tensor | None,
        real: torch.Tensor | None,
    ) -> torch.Tensor:
        h = self.input_layernorm(x)
        if self.layer_type == "linear_attention":
            h = self.linear_attn(h, slot, real)
        else:
            h = self.self_attn(h, rope, slot, attn_mask)
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x))
