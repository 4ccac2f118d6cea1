"""Gated full attention: GQA with per-head q/k RMSNorm, partial mRoPE and a sigmoid output gate."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from . import kernels
from .cache import Cache, KVSlot
from .config import TextConfig
from .formats import stored
from .linear import Linear
from .norm import RMSNorm
from .rotary import apply_partial_rotary


def attention_mask_for(cache: Cache, num_tokens: int) -> torch.Tensor | None:
    """Boolean mask `[B, 1, T, L]` (True = may attend) for the next `num_tokens` queries, or None.

    None means plain causal attention of the T queries as the last T of the L written positions, with
    no padding: query i sees keys j <= L - T + i (a fresh sequence, a later chunk of an unpadded
    prompt, an unpadded decode step). Queries always see their own position, so a left-padding
    query never has an empty row.
    """
    start, end = cache.length, cache.length + num_tokens
    if cache.lengths is not None:  # ragged: row b's one query sees its own positions [0, lengths[b]]
        if bool((cache.lengths == start).all()):
            return None
        return (torch.arange(end, device=cache.lengths.device)[None, :] <= cache.lengths[:, None])[:, None, None]
    if not cache.padded:  # no written position is padding: spares the pass over the mask
        return None
    keys = cache.key_mask[:, :end]  # [B, L]
    if bool(keys.all()):
        return None
    q_pos = torch.arange(start, end, device=keys.device)[:, None]  # [T, 1]
    k_pos = torch.arange(end, device=keys.device)[None, :]  # [1, L]
    mask = keys[:, None, :] & (k_pos <= q_pos)  # [B, T, L]
    mask |= k_pos == q_pos
    return mask[:, None]


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float):
    """Attention of one new token per row: q [B, H, 1, D] over k, v [B, KV, L, D] -> [B, H, 1, D].

    The H / KV query heads sharing a KV head become rows of one product, so K and V are streamed
    once (no per-head copies); `[L, D] @ [D, rep]` keeps the long dimension contiguous. mask [B, 1, 1, L].
    """
    if (fused := kernels.decode_attention(q, k, v, mask, scale)) is not None:  # CPU: one pass over the cache
        return fused
    b, h, _, d = q.shape
    kv, length = k.shape[1], k.shape[2]
    scores = torch.bmm(k.reshape(b * kv, length, d), q.reshape(b * kv, h // kv, d).transpose(1, 2))  # [B*KV, L, rep]
    scores = scores * scale
    if mask is not None:
        keep = mask.reshape(b, 1, length, 1).expand(b, kv, length, 1).reshape(b * kv, length, 1)
        scores = scores.masked_fill(~keep, float("-inf"))
    probs = torch.softmax(scores, dim=1)
    return torch.bmm(probs.transpose(1, 2), v.reshape(b * kv, length, d)).view(b, h, 1, d)


class GatedAttention(nn.Module):
    def __init__(self, config: TextConfig):
        super().__init__()
        h, d = config.hidden_size, config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, d
        bias = config.attention_bias
        self.q_proj = Linear(h, self.num_heads * d * 2, bias=bias)  # per head: [query | gate]
        self.k_proj = Linear(h, self.num_kv_heads * d, bias=bias)
        self.v_proj = Linear(h, self.num_kv_heads * d, bias=bias)
        self.o_proj = Linear(self.num_heads * d, h, bias=bias)
        self.q_norm = RMSNorm(d, eps=config.rms_norm_eps)
        self.k_norm = RMSNorm(d, eps=config.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        slot: KVSlot,
        mask: torch.Tensor | None,
    ) -> torch.Tensor:
        b, t, _ = x.shape
        d = self.head_dim
        q, k, v = self._project(x)
        q, gate = q.view(b, t, self.num_heads, 2 * d).chunk(2, dim=-1)  # [B, T, H, D] each
        q = self.q_norm(q).transpose(1, 2)  # [B, H, T, D]
        k = self.k_norm(k.view(b, t, self.num_kv_heads, d)).transpose(1, 2)  # [B, KV, T, D]
        v = v.view(b, t, self.num_kv_heads, d).transpose(1, 2)
        cos, sin = rope
        q, k = apply_partial_rotary(q, cos, sin), apply_partial_rotary(k, cos, sin)
        k, v = slot.append(k, v)  # [B, KV, L, D]
        if t == 1:
            out = decode_attention(q, k, v, mask, d**-0.5).transpose(1, 2)
        else:
            out = self._prefill_attention(q, k, v, mask).to(x.dtype)  # [B, T, H, D]
        out = out.reshape(b, t, self.num_heads * d)
        return self.o_proj(out * torch.sigmoid(gate.reshape(b, t, -1)))

    def _prefill_attention(self, q, k, v, mask) -> torch.Tensor:
        """q [B, H, T, D], k and v [B, KV, L, D] -> [B, T, H, D], in the layer's compute format (that of
        its projections, lm/kernels/compute.py): under bf16 or int8 compute, bf16 queries, keys and
        values with float32 softmax and sums, through the bf16 attention kernel where it runs (AVX512-BF16
        without AMX; no mask: causal with no padding, any chunk of a prompt) and SDPA under bf16 compute
        elsewhere; the cache keeps float32."""
        scale = self.head_dim**-0.5
        how = kernels.prefill_compute(self.o_proj.compute, stored(self.o_proj), q)
        plain = mask is None and q.device.type == "cpu"  # causal, the queries the last of the keys
        attend = kernels.bf16_attention_kernel(self.head_dim) if how != "fp32" and plain else None
        if attend is not None:
            return attend(*(z.transpose(1, 2).to(torch.bfloat16) for z in (q, k, v)), scale, True)
        if how == "bf16":
            q, k, v = (z.to(torch.bfloat16) for z in (q, k, v))
        t, length = q.shape[2], k.shape[2]
        if mask is None and length > t:  # SDPA's is_causal aligns the queries with the first keys, not the last
            mask = torch.arange(length, device=q.device) <= torch.arange(length - t, length, device=q.device)[:, None]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale,
                                             enable_gqa=True)  # fmt: skip
        return out.transpose(1, 2)

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q (with its gate half), k, v projections; on CPU decode rows as one kernel call."""
        fused = kernels.multi_linear(x, [stored(self.q_proj), stored(self.k_proj), stored(self.v_proj)])
        if fused is None:
            return self.q_proj(x), self.k_proj(x), self.v_proj(x)
        for y, proj in zip(fused, (self.q_proj, self.k_proj, self.v_proj)):
            if proj.bias is not None:
                y += proj.bias
        return tuple(fused)
