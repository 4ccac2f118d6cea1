"""Typed configuration of the Qwen3.5 / Qwen3.6 vision tower, built from the HF `vision_config` dict."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

# Accepted `model_type` values of the vision sub-config (old checkpoints carry the parent's type).
_MODEL_TYPES = frozenset({"qwen3_5_moe_vision", "qwen3_5_vision", "qwen3_5_moe", "qwen3_5"})
_HIDDEN_ACTS = frozenset({"gelu_pytorch_tanh"})
# transformers' vision rotary uses `rope_theta` 10000.0 when `rope_parameters` is absent.
DEFAULT_ROPE_THETA = 10000.0


@dataclass(frozen=True)
class VisionConfig:
    """Sizes of the vision tower. Defaults are the Qwen3.5-35B-A3B tower."""

    depth: int = 27
    hidden_size: int = 1152
    hidden_act: str = "gelu_pytorch_tanh"
    intermediate_size: int = 4304
    num_heads: int = 16
    in_channels: int = 3
    patch_size: int = 16
    spatial_merge_size: int = 2
    temporal_patch_size: int = 2
    out_hidden_size: int = 2048
    num_position_embeddings: int = 2304
    rope_theta: float = DEFAULT_ROPE_THETA
    layer_norm_eps: float = 1e-6

    def __post_init__(self) -> None:
        _validate(self)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        """Length of one flattened patch: in_channels * temporal_patch_size * patch_size**2."""
        return self.in_channels * self.temporal_patch_size * self.patch_size**2

    @property
    def num_grid_per_side(self) -> int:
        """Side of the square learned position-embedding grid (48 for 2304 embeddings)."""
        return math.isqrt(self.num_position_embeddings)

    @property
    def merge_unit(self) -> int:
        """Patches merged into one output token (4 for a 2x2 merge)."""
        return self.spatial_merge_size**2

    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> VisionConfig:
        """Build from an HF `vision_config` dict (or a full config dict holding one).

        Raises ValueError for anything this tower cannot run: deepstack layers, an unknown
        activation or model type, a non-axial rope, a non-square position grid, odd head dims.
        """
        if "vision_config" in d:
            d = d["vision_config"]
        model_type = d.get("model_type")
        if model_type is not None and model_type not in _MODEL_TYPES:
            raise ValueError(
                f"vision_config.model_type {model_type!r} is not supported (expected one of {sorted(_MODEL_TYPES)})")
        deepstack = d.get("deepstack_visual_indexes") or []
        if deepstack:
            raise ValueError(f"deepstack_visual_indexes={deepstack} is not supported (only [] is)")
        head_dim = d.get("hidden_size", cls.hidden_size) // d.get("num_heads", cls.num_heads)
        if d.get("head_dim") not in (None, head_dim):
            raise ValueError(f"vision_config.head_dim={d['head_dim']} != hidden_size // num_heads; not supported")
        defaults = cls()
        kwargs = {name: d.get(name, getattr(defaults, name)) for name in _HF_FIELDS}
        for name in ("patch_size", "temporal_patch_size"):
            kwargs[name] = _scalar_size(name, kwargs[name])
        return cls(**kwargs, rope_theta=_rope_theta(d))


_HF_FIELDS = (
    "depth", "hidden_size", "hidden_act", "intermediate_size", "num_heads", "in_channels", "patch_size",
    "spatial_merge_size", "temporal_patch_size", "out_hidden_size", "num_position_embeddings",
)


def _scalar_size(name: str, value: Any) -> int:
    """Patch sizes may be written as a list of equal sides; anything non-square is refused."""
    if isinstance(value, (list, tuple)):
        if len(set(value)) != 1:
            raise ValueError(f"vision_config.{name}={value} is not supported (sides must be equal)")
        value = value[0]
    return int(value)


def _rope_theta(d: dict[str, Any]) -> float:
    """Vision rotary base: `rope_parameters.rope_theta`, else a top-level `rope_theta`, else 10000."""
    params = d.get("rope_parameters") or {}
    rope_type = params.get("rope_type", params.get("type", "axial"))
    if rope_type != "axial":
        raise ValueError(f"vision rope_type {rope_type!r} is not supported (only 'axial')")
    return float(params.get("rope_theta", d.get("rope_theta", DEFAULT_ROPE_THETA)))


def _validate(c: VisionConfig) -> None:
    if c.hidden_act not in _HIDDEN_ACTS:
        raise ValueError(
            f"vision hidden_act {c.hidden_act!r} is not supported (expected one of {sorted(_HIDDEN_ACTS)})")
    side = math.isqrt(c.num_position_embeddings)
    if c.num_position_embeddings <= 0 or side * side != c.num_position_embeddings:
        raise ValueError(f"num_position_embeddings={c.num_position_embeddings} is not a perfect square")
    if c.hidden_size % c.num_heads:
        raise ValueError(f"hidden_size={c.hidden_size} is not divisible by num_heads={c.num_heads}")
    if c.head_dim % 4:
        raise ValueError(f"head_dim={c.head_dim} must be a multiple of 4 for the 2D (h, w) rotary")
    for name in ("depth", "intermediate_size", "in_channels", "patch_size", "spatial_merge_size",
                 "temporal_patch_size", "out_hidden_size"):
        if getattr(c, name) <= 0:
            raise ValueError(f"vision_config.{name}={getattr(c, name)} must be positive")
