"""The CPU decode fast path: one token per row through all layers, calling the C++ kernels directly.

A decode step of the layer-by-layer path spends about 1 ms in Python around its kernels (some 110
module calls, ~700 attribute look-ups, views and argument checks): 5-10% of a batch-1 step of the
benchmark model. This loop does the same maths with the same kernels and little else: per Gated
DeltaNet layer a norm, the input projections, the fused DeltaNet token step, out_proj, a norm and
the MoE block's fused call; per attention layer the layer's projections, one fused call from q/k/v
to the gated attention output (attention_token.cpp) and o_proj (dense MLPs go through their module,
which uses the kernels too). It applies to float32 CPU activations with the kernels on (`QWEN35_CPU_KERNELS`),
at most `kernels.MAX_ROWS` rows and DeltaNet value heads the fused step supports; the caller falls
back to the layers otherwise. tests/lm/test_decode.py checks it against the reference path.
"""

from __future__ import annotations

import torch

from . import kernels
from .cache import Cache
from .moe import SparseMoeBlock


def decode_layers(model, x: torch.Tensor, cache: Cache, rope, attn_mask) -> torch.Tensor | None:
    """`model` a `TextModel`; x [B, 1, hidden] token embeddings whose position the cache has reserved.
    Returns the final-normed hidden states [B, 1, hidden], or None when the fast path does not apply."""
    k = kernels._fusable(x)
    if k is None or x.shape[0] > kernels.MAX_ROWS or model.config.linear_value_head_dim % 16:
        return None
    h = x[:, 0]  # [B, hidden], the residual stream
    for layer, slot in zip(model.layers, cache.slots.values()):
        norm = layer.input_layernorm
        n = k.rms_norm(h, norm.weight, norm.eps, 1.0)
        if layer.layer_type == "linear_attention":
            h = h + deltanet_token(k, layer.linear_attn, n, slot)
        else:
            h = h + attention_token(k, layer.self_attn, n, slot, rope, attn_mask)
        norm = layer.post_attention_layernorm
        n = k.rms_norm(h, norm.weight, norm.eps, 1.0)
        mlp = layer.mlp
        out = mlp.fused(n) if isinstance(mlp, SparseMoeBlock) else None
        h = h + (mlp(n) if out is None else out)
    return k.rms_norm(h, model.norm.weight, model.norm.eps, 1.0)[:, None]


def deltanet_token(k, layer, x: torch.Tensor, slot) -> torch.Tensor:
    """`GatedDeltaNet.forward` of one token per row x [B, hidden] through the kernel module `k`: the
    four input projections in one call, then conv, norms, gates, recurrence and gated norm in one
    (delta_step.cpp; value head dims divisible by 16), then out_proj. Updates the slot in place."""
    qkv, z, b, a = k.multi_linear(x, [layer.in_proj_qkv.weight, layer.in_proj_z.weight,
                                      layer.in_proj_b.weight, layer.in_proj_a.weight])
    conv = layer.conv1d.weight
    out = k.gdn_decode(qkv, z, b, a, slot.conv, conv.view(conv.shape[0], -1), layer.A_log, layer.dt_bias,
                       slot.recurrent, layer.norm.weight, layer.norm.eps, layer.num_k_heads)
    return k.small_m_linear(out, layer.out_proj.weight)


_NO_MASK = torch.empty(0, dtype=torch.bool)


def attention_token(k, layer, x: torch.Tensor, slot, rope, mask: torch.Tensor | None) -> torch.Tensor:
    """`GatedAttention.forward` of one token per row x [B, hidden] through the kernel module `k`:
    the layer's q/k/v projections, then q/k norms, rotary, the KV cache write, attention and the
    output gate in one call (attention_token.cpp), then o_proj. A query/KV head ratio the attention
    kernel does not take goes through the module instead."""
    if layer.num_heads // layer.num_kv_heads not in kernels.ATTENTION_GROUPS:
        return layer(x[:, None], rope, slot, mask)[:, 0]
    q, key, value = layer.project(x)
    cos, sin = rope  # [B, 1, R]
    # q_norm and k_norm share the config's rms_norm_eps, so the kernel takes one eps
    keep = _NO_MASK if mask is None else mask.reshape(x.shape[0], -1)
    out = k.attention_token(q, key, value, layer.q_norm.weight, layer.k_norm.weight, layer.q_norm.eps, cos[:, 0],
                            sin[:, 0], slot.k, slot.v, slot.cache.length, keep, layer.head_dim**-0.5)
    return layer.o_proj(out)
