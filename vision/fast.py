"""Allocation-free fast path of the vision block (inference only).

Same maths as `VisionBlock.forward` (the reference path), reordered to avoid large temporaries:
on CPU every fresh buffer above glibc's mmap threshold (32 MiB: the qkv, rotary and MLP
activations of a large image) is page-faulted in on every layer, which costs several percent of
the tower's time. Here

- the qkv, rotated q/k and fc1 activations live in a per-forward `Workspace`, reused by all blocks;
- GELU runs in place; the residual adds are fused into the output projections (`x.addmm_`),
  so `x` is updated in place (the caller owns it).

The only numerical difference from the reference path is the order of the bias and residual
adds (x + W a + b instead of x + (W a + b)), a float32 rounding-level change.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .attention import Segments, segment_attention
from .linear import used
from .rotary import apply_rotary


class Workspace:
    """Named scratch buffers for one forward pass, reused across blocks."""

    def __init__(self, device: torch.device, dtype: torch.dtype) -> None:
        self.device, self.dtype = device, dtype
        self._buffers: dict[str, torch.Tensor] = {}

    def get(self, name: str, shape: tuple[int, ...], dtype: torch.dtype | None = None) -> torch.Tensor:
        """A buffer of `shape` (and `dtype`, default the workspace's); its contents are whatever the
        last user left there."""
        buf = self._buffers.get(name)
        if buf is None or buf.shape != shape:
            buf = torch.empty(shape, device=self.device, dtype=dtype or self.dtype)
            self._buffers[name] = buf
        return buf


def rotate_into(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """float32 rotary of `x [N, ..., D]` written into `out` (same shape); see `rotary.apply_rotary`."""
    half = x.shape[-1] // 2
    bshape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (half,)
    cos, sin = cos.view(bshape), sin.view(bshape)  # [N, 1.., D/2]
    x1, x2, o1, o2 = x[..., :half], x[..., half:], out[..., :half], out[..., half:]
    torch.mul(x1, cos, out=o1).addcmul_(x2, sin, value=-1)  # x1 cos - x2 sin
    torch.mul(x2, cos, out=o2).addcmul_(x1, sin)  # x2 cos + x1 sin
    return out


def fast_block(block: torch.nn.Module, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               segments: Segments, ws: Workspace, compute: str = "fp32", attend=None) -> torch.Tensor:
    """`VisionBlock` forward updating `x [N, C]` in place; scratch from `ws`; the products in
    `compute` (vision/linear.py: "fp32", or "bf16"), bf16 attention through `attend` when given
    (`VisionModel.attend`). Returns x."""
    if compute == "bf16" and x.dtype == torch.float32:
        return _bf16_block(block, x, cos, sin, segments, ws, attend)
    attn, mlp = block.attn, block.mlp
    n, c = x.shape
    heads, head_dim = attn.num_heads, attn.head_dim
    h = F.layer_norm(x, (c,), block.norm1.weight, block.norm1.bias, block.norm1.eps)
    qkv = _affine(h, attn.qkv, ws.get("qkv", (n, 3 * c))).view(n, 3, heads, head_dim)  # [N, 3, H, D]
    if qkv.dtype == torch.float32:
        qk = rotate_into(qkv[:, :2], cos, sin, ws.get("qk", (n, 2, heads, head_dim)))  # [N, 2, H, D]
    else:  # the reference rotates in float32 and rounds back
        qk = apply_rotary(qkv[:, :2], cos, sin)
    o = segment_attention(qk[:, 0], qk[:, 1], qkv[:, 2], segments)  # [N, C]
    _add_affine(x, o, attn.proj)
    h = F.layer_norm(x, (c,), block.norm2.weight, block.norm2.bias, block.norm2.eps)
    fc1 = mlp.linear_fc1
    f = _affine(h, fc1, ws.get("fc1", (n, fc1.out_features)))  # [N, I]
    torch.ops.aten.gelu_(f, approximate="tanh")
    return _add_affine(x, f, mlp.linear_fc2)


def _bf16_block(block: torch.nn.Module, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                segments: Segments, ws: Workspace, attend=None) -> torch.Tensor:
    """The block with bf16 products for a float32 residual stream `x [N, C]` (updated in place):
    the norms' outputs rounded to bf16 once, each product's output left in bf16 (oneDNN's bf16 GEMM,
    float32 sums, the bias added before the rounding) and fed as it is to the next step: rotary
    (float32, rounded back), attention (SDPA or `attend`: float32 softmax and sums inside), GELU;
    only the two residual updates come back to float32, each added with its bias in float32. Against float32 compute on
    the same weights, each product's inputs and output are rounded to bf16 (tests/lm/test_compute.py).
    The large activations live in `ws`, as in `fast_block`."""
    attn, mlp = block.attn, block.mlp
    n, c = x.shape
    heads, head_dim, bf16 = attn.num_heads, attn.head_dim, torch.bfloat16
    h = _bf16_norm(x, block.norm1, ws)
    qkv = torch.addmm(attn.qkv.bias.to(bf16), h, attn.qkv.weight.to(bf16).t(), out=ws.get("qkv16", (n, 3 * c), bf16))
    qkv = qkv.view(n, 3, heads, head_dim)
    qk = rotate_into(qkv[:, :2], cos, sin, ws.get("qk", (n, 2, heads, head_dim)))  # float32
    qk = ws.get("qk16", (n, 2, heads, head_dim), bf16).copy_(qk)
    o = segment_attention(qk[:, 0], qk[:, 1], qkv[:, 2], segments, attend)  # [N, C] bf16
    update = ws.get("update16", (n, c), bf16)
    x.add_(torch.mm(o, attn.proj.weight.to(bf16).t(), out=update)).add_(attn.proj.bias)
    h = _bf16_norm(x, block.norm2, ws)
    fc1 = mlp.linear_fc1
    f = torch.addmm(fc1.bias.to(bf16), h, fc1.weight.to(bf16).t(), out=ws.get("fc1_16", (n, fc1.out_features), bf16))
    torch.ops.aten.gelu_(f, approximate="tanh")
    return x.add_(torch.mm(f, mlp.linear_fc2.weight.to(bf16).t(), out=update)).add_(mlp.linear_fc2.bias)


def _bf16_norm(x: torch.Tensor, norm: torch.nn.LayerNorm, ws: Workspace) -> torch.Tensor:
    """LayerNorm of float32 `x [N, C]` in float32, rounded to bf16, in `ws`."""
    n, c = x.shape
    h = ws.get("h", (n, c))
    torch.ops.aten.native_layer_norm.out(x, (c,), norm.weight, norm.bias, norm.eps,
                                         out0=h, out1=ws.get("mean", (n, 1)), out2=ws.get("rstd", (n, 1)))
    return ws.get("h16", (n, c), torch.bfloat16).copy_(h)


def _affine(h: torch.Tensor, linear: torch.nn.Linear, out: torch.Tensor) -> torch.Tensor:
    """linear(h) into `out`, one addmm."""
    return torch.addmm(linear.bias, h, used(linear.weight, h).t(), out=out)


def _add_affine(x: torch.Tensor, a: torch.Tensor, linear: torch.nn.Linear) -> torch.Tensor:
    """x += linear(a), in place."""
    return x.addmm_(a, used(linear.weight, x).t()).add_(linear.bias)
