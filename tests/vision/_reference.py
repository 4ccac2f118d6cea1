"""Shared helpers for the vision tests: tiny HF configs, perturbed reference towers, synthetic patches."""

from __future__ import annotations

import torch
from transformers import Qwen3_5MoeVisionConfig, Qwen3_5VisionConfig
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5VisionModel
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeVisionModel

from vision import VisionConfig, VisionModel

TINY = dict(
    depth=2, hidden_size=64, num_heads=4, intermediate_size=128, out_hidden_size=48,
    num_position_embeddings=2304, patch_size=16, temporal_patch_size=2, spatial_merge_size=2,
    in_channels=3, hidden_act="gelu_pytorch_tanh", deepstack_visual_indexes=[],
)


def hf_vision_config(moe: bool = True, **overrides) -> Qwen3_5MoeVisionConfig | Qwen3_5VisionConfig:
    cls = Qwen3_5MoeVisionConfig if moe else Qwen3_5VisionConfig
    return cls(**{**TINY, **overrides})


def perturbed_reference(hf_config, seed: int = 0) -> torch.nn.Module:
    """A float32 reference tower (sdpa attention) with every parameter moved away from its init."""
    torch.manual_seed(seed)
    cls = Qwen3_5MoeVisionModel if isinstance(hf_config, Qwen3_5MoeVisionConfig) else Qwen3_5VisionModel
    hf_config._attn_implementation = "sdpa"
    ref = cls(hf_config).float().eval()
    with torch.no_grad():
        for param in ref.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    return ref


def ours_from(ref: torch.nn.Module, fast: bool = True) -> VisionModel:
    """Our tower (fast or reference path) with the reference's weights, loaded by name (state_dict, strict)."""
    model = VisionModel(VisionConfig.from_hf(ref.config.to_dict()), fast=fast).float().eval()
    model.load_state_dict(ref.state_dict(), strict=True)
    return model


def patches(grid_thw: list[list[int]], patch_dim: int = 1536, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    grid = torch.tensor(grid_thw, dtype=torch.long)
    n = int((grid[:, 0] * grid[:, 1] * grid[:, 2]).sum())
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, patch_dim, generator=gen), grid


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max|a - b| / max|b|."""
    return float((a - b).abs().max() / b.abs().max())
