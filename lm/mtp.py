"""The multi-token-prediction (MTP) layer that Qwen3.5 / Qwen3.6 checkpoints ship as `mtp.*`.

It drafts the token after next from the main model's last hidden state and the next token. Names
equal the checkpoint's (`mtp.fc.weight`, `mtp.layers.0.self_attn.q_proj.weight`, ...), the decoder
layer is the main model's `DecoderLayer` (full attention; MoE or dense MLP as the main layers), and
the embedding table, the LM head and the rotary angles are the main model's.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from .attention import attention_mask_for
from .cache import Cache
from .config import ConfigError, TextConfig
from .decoder import DecoderLayer
from .linear import Linear
from .norm import RMSNorm


class MTPLayer(nn.Module):
    """One MTP step. For the token `t` at position p (the token after the one whose hidden state is h):

        e = pre_fc_norm_embedding(embed(t))           # zero-centred RMSNorms, as the main model's
        h = pre_fc_norm_hidden(h_main)                # h_main: the hidden state the LM head reads
        x = fc(cat([e, h], -1))                       # fc [H, 2H]: embedding first, then hidden
        x = layers[0](x, position p)                  # a full-attention decoder layer, own KV cache
        g = norm(x);  logits = lm_head(g)             # the draft of the token after t

    `h_main` is the main model's final hidden state AFTER its final norm (the input of its LM head),
    as vLLM's qwen3_5_mtp / qwen3_next_mtp take it (the target model's forward returns its normed
    states). Drafting k > 1 tokens applies this one layer recursively: step j + 1 takes the token
    drafted at step j and, as h_main, step j's own `g` (vLLM's spec_step_idx loop over one layer).
    The MTP KV cache holds one position per main-model position: position i is written from
    (token i + 1, h_main of token i) at token i's mRoPE position.
    """

    def __init__(self, config: TextConfig):
        super().__init__()
        if config.mtp_num_hidden_layers > 1:
            raise ConfigError(f"mtp_num_hidden_layers={config.mtp_num_hidden_layers}: one MTP layer is implemented")
        if config.mtp_use_dedicated_embeddings:
            raise ConfigError("mtp_use_dedicated_embeddings=true is not implemented (the MTP layer shares the "
                              "main model's embedding table)")  # fmt: skip
        h, eps = config.hidden_size, config.rms_norm_eps
        self.layer_config = dataclasses.replace(config, num_hidden_layers=1, layer_types=("full_attention",))
        self.pre_fc_norm_embedding = RMSNorm(h, eps=eps)
        self.pre_fc_norm_hidden = RMSNorm(h, eps=eps)
        self.fc = Linear(2 * h, h, bias=False)
        self.layers = nn.ModuleList([DecoderLayer(self.layer_config, 0)])
        self.norm = RMSNorm(h, eps=eps)

    def make_cache(self, batch: int, max_len: int) -> Cache:
        """The MTP layer's own KV cache (one full-attention slot)."""
        w = self.norm.weight
        return Cache(self.layer_config, batch, max_len, device=w.device, dtype=w.dtype)

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                cache: Cache, attention_mask: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
        """embeds [B, T, H]: the embeddings of the next tokens; hidden [B, T, H]: the hidden states
        of the tokens before them (see the class docstring); rope: the main model's rotary (cos, sin)
        at the T positions; attention_mask [B, T]: 0 on left padding. Writes T positions of `cache`;
        returns g [B, T, H] (normed)."""
        x = self.fc(torch.cat([self.pre_fc_norm_embedding(embeds), self.pre_fc_norm_hidden(hidden)], dim=-1))
        t = x.shape[1]
        cache.begin(attention_mask, t)
        x = self.layers[0](x, cache.slots[0], rope, attention_mask_for(cache, t), None)
        cache.advance(t)
        return self.norm(x)
