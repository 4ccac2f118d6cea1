"""The Qwen3.5 / Qwen3.6 vision tower.

Module and parameter names equal the HF names under `model.visual.`, so a checkpoint maps 1:1.
Data flow for packed patches of n images/videos (N patches in all, 2x2-merge-block order):

    patches [N, 3*2*16*16] -> patch_embed (one matmul) + resampled pos_embed -> [N, C]
    -> depth x (x + attn(norm1(x)); x + mlp(norm2(x)))  (attention within each frame group)
    -> merger -> [N/4, out_hidden_size]

The tower is inference-only (forward runs without autograd). `VisionModel(config, fast=True)` runs
the blocks through `fast.fast_block` (in-place residuals, reused scratch buffers); `fast=False` runs
the plain module code below, the reference the fast path is tested against.

Storage: the tower's matrices (`STORED`) may be held in bfloat16 while it computes in float32
(`store_matrices_in`, chosen by `weights=` at load): each is converted right where it is used, one
matrix at a time, which is exact (bf16 -> fp32 is) and halves the tower's memory. Biases, norms and
the position table stay in the compute dtype, which `VisionModel.dtype` names.
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from .attention import Segments, VisionAttention
from .config import VisionConfig
from .fast import Workspace, fast_block
from .linear import Linear, used
from .merger import PatchMerger
from .pos_embed import resampled_pos_embed
from .rotary import inv_freq, merge_order_positions, rotary_cos_sin


class PatchEmbed(nn.Module):
    """Conv3d with stride == kernel over (C, T, P, P) patches, applied as one matmul."""

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        kernel = (config.temporal_patch_size, config.patch_size, config.patch_size)
        self.proj = nn.Conv3d(config.in_channels, config.hidden_size, kernel_size=kernel, stride=kernel, bias=True)

    def forward(self, patches: torch.Tensor, compute: str = "fp32") -> torch.Tensor:
        """`patches [N, C_in*T*P*P]` -> `[N, hidden]`; with `compute` "bf16" (float32 patches) a bf16
        product (vision/linear.py) plus the float32 bias."""
        patches = patches.to(self.proj.bias.dtype)
        if compute == "bf16" and patches.dtype == torch.float32:
            weight = self.proj.weight.to(torch.bfloat16).view(self.proj.out_channels, -1)
            return F.linear(patches.to(torch.bfloat16), weight).float().add_(self.proj.bias)
        weight = used(self.proj.weight, patches).view(self.proj.out_channels, -1)  # [hidden, C_in*T*P*P]
        return F.linear(patches, weight, self.proj.bias)


class VisionMLP(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.linear_fc1 = Linear(config.hidden_size, config.intermediate_size, bias=True)
        self.linear_fc2 = Linear(config.intermediate_size, config.hidden_size, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(F.gelu(self.linear_fc1(x), approximate="tanh"))


class VisionBlock(nn.Module):
    """Pre-norm transformer block: LayerNorm (eps 1e-6), segment attention, GELU-tanh MLP."""

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.norm2 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.attn = VisionAttention(config.hidden_size, config.num_heads)
        self.mlp = VisionMLP(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, segments: Segments) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, segments)
        return x + self.mlp(self.norm2(x))


STORED = re.compile(r"^(patch_embed\.proj|blocks\.\d+\.(attn\.(qkv|proj)|mlp\.linear_fc[12])|merger\.linear_fc[12])\.weight$")


class VisionModel(nn.Module):
    """Vision tower: `forward(pixel_values [N, patch_dim], grid_thw [n, 3]) -> [N / 4, out_hidden_size]`."""

    def __init__(self, config: VisionConfig, *, fast: bool = True) -> None:
        super().__init__()
        self.config = config
        self.fast = fast
        self.compute = "fp32"  # the blocks' products: "fp32" or "bf16" (vision/linear.py); set at load
        # bf16 compute's attention: None (torch's SDPA) or a kernel attend(q, k, v, scale) of bf16
        # [B, L, H, D] with no mask, given at load by whoever has one (mm: lm.kernels.bf16_attention_kernel)
        self.attend = None
        # the most patches the fast path holds activations for at once (a 30 s clip at the captioner's
        # defaults is ~48,000: ~3 GB of them at the 35B's size; 16,384: ~1 GB)
        self.slice_patches = 16384
        self.patch_embed = PatchEmbed(config)
        self.pos_embed = nn.Embedding(config.num_position_embeddings, config.hidden_size)
        self.blocks = nn.ModuleList(VisionBlock(config) for _ in range(config.depth))
        self.merger = PatchMerger(config.hidden_size, config.merge_unit, config.out_hidden_size, config.layer_norm_eps)

    @property
    def dtype(self) -> torch.dtype:
        """The compute dtype (pixels go in, features come out in it), whatever the matrices' storage."""
        return self.patch_embed.proj.bias.dtype

    def store_matrices_in(self, dtype: torch.dtype) -> None:
        """Hold the `STORED` matrices in `dtype` (bf16 storage beside float32 compute). On the meta
        device, before allocation and loading; the tower's outputs are unchanged when the checkpoint
        holds those matrices in `dtype` already."""
        for name, param in list(self.named_parameters()):
            if STORED.match(name) and param.dtype != dtype:
                owner = self.get_submodule(name.rpartition(".")[0])
                owner.weight = nn.Parameter(param.detach().to(dtype), requires_grad=False)

    @torch.no_grad()
    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """Merged embeddings of all images/videos, concatenated in order: `[N / 4, out_hidden_size]`.

        `pixel_values [N, C_in*T*P*P]` are the preprocessor's patches, each frame group's h*w patches
        in 2x2-merge-block order; `grid_thw [n, 3]` gives (t, h, w) per image/video, N = sum(t*h*w).
        Equal to transformers' `Qwen3_5MoeVisionModel(...).pooler_output`. Every frame attends only
        to itself and every other step is per patch, so the fast path runs many frames (a video) in
        slices of whole frames of at most `slice_patches` patches: the same values (up to the float
        rounding of GEMMs of other sizes), a fraction of the activations' memory.
        """
        grids = self._grids(pixel_values, grid_thw)
        frames = [(1, h, w) for t, h, w in grids for _ in range(t)]
        if self.fast and len(frames) > 1 and pixel_values.shape[0] > self.slice_patches:
            return torch.cat([self._forward(pixel_values[a:b], part) for a, b, part in self._slices(frames)])
        return self._forward(pixel_values, grids)

    def _slices(self, frames: list[tuple[int, int, int]]):
        """(first patch, end patch, frames) of consecutive whole frames, each slice at most
        `slice_patches` patches (or one larger frame)."""
        start, part, size = 0, [], 0
        for frame in frames:
            n = frame[1] * frame[2]
            if part and size + n > self.slice_patches:
                yield start, start + size, part
                start, part, size = start + size, [], 0
            part.append(frame)
            size += n
        yield start, start + size, part

    def _forward(self, pixel_values: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        pos, cos, sin = self._grid_tables(grids)
        x = self.patch_embed(pixel_values, self.compute) + pos  # [N, C]
        segments = Segments.from_lengths([h * w for t, h, w in grids for _ in range(t)])
        if self.fast:
            ws = Workspace(x.device, x.dtype)
            for block in self.blocks:
                x = fast_block(block, x, cos, sin, segments, ws, self.compute, self.attend)
        else:
            for block in self.blocks:
                x = block(x, cos, sin, segments)
        return self.merger(x, self.compute)

    def _grids(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> list[tuple[int, int, int]]:
        """grid_thw as Python ints, checked against pixel_values and the merge size."""
        if grid_thw.dim() != 2 or grid_thw.shape[1] != 3:
            raise ValueError(f"grid_thw must be [n, 3], got {tuple(grid_thw.shape)}")
        grids = [(int(t), int(h), int(w)) for t, h, w in grid_thw.tolist()]
        merge = self.config.spatial_merge_size
        for t, h, w in grids:
            if t <= 0 or h <= 0 or w <= 0 or h % merge or w % merge:
                raise ValueError(f"grid (t={t}, h={h}, w={w}) must be positive with h, w multiples of {merge}")
        expected = (sum(t * h * w for t, h, w in grids), self.config.patch_dim)
        if pixel_values.dim() != 2 or tuple(pixel_values.shape) != expected:
            raise ValueError(
                f"pixel_values must be {list(expected)} for grid_thw {grids}, got {list(pixel_values.shape)}")
        return grids

    def _grid_tables(self, grids: list[tuple[int, int, int]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Position embeddings `[N, C]` and rotary cos, sin `[N, D/2]`, computed once per distinct (h, w)."""
        merge = self.config.spatial_merge_size
        table = self.pos_embed.weight
        freqs = inv_freq(self.config.head_dim, self.config.rope_theta)  # float32 [D/4], whatever the model dtype
        per_hw: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        for _, h, w in grids:
            if (h, w) not in per_hw:
                positions = merge_order_positions(h, w, merge, table.device)  # [h*w, 2]
                cos, sin = rotary_cos_sin(positions, freqs)
                per_hw[h, w] = (resampled_pos_embed(table, h, w, merge), cos, sin)
        frames = [per_hw[h, w] for t, h, w in grids for _ in range(t)]
        if len(frames) == 1:
            return frames[0]
        return tuple(torch.cat(parts) for parts in zip(*frames))  # type: ignore[return-value]
