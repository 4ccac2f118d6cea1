"""All checkpoint-name knowledge of the vision tower.

The tower's parameter names equal the checkpoint names under `model.visual.` (the VL checkpoints'
layout), so the mapping is `prefix + name` with no renames, fusions or transposes:

    model.visual.patch_embed.proj.{weight [C, 3, 2, 16, 16], bias}
    model.visual.pos_embed.weight [2304, C]
    model.visual.blocks.{i}.{norm1,norm2}.{weight,bias}
    model.visual.blocks.{i}.attn.{qkv [3C, C],proj [C, C]}.{weight,bias}
    model.visual.blocks.{i}.mlp.{linear_fc1,linear_fc2}.{weight,bias}
    model.visual.merger.{norm [C],linear_fc1 [4C, 4C],linear_fc2 [out, 4C]}.{weight,bias}
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

import torch

from .model import VisionModel

VL_PREFIX = "model.visual."


class WeightError(ValueError):
    """A checkpoint does not match the vision tower: missing, unexpected or mis-shaped tensor."""


class TensorReader(Protocol):
    """Streaming access to a checkpoint: every tensor name, and one tensor at a time."""

    def keys(self) -> Iterable[str]: ...

    def get(self, name: str) -> torch.Tensor: ...


def expected_vision_keys(model: VisionModel, prefix: str = VL_PREFIX) -> dict[str, torch.nn.Parameter]:
    """Checkpoint key -> parameter it loads into, for every parameter of the tower."""
    return {prefix + name: param for name, param in model.named_parameters()}


def load_vision_weights(model: VisionModel, reader: TensorReader, *, prefix: str = VL_PREFIX) -> set[str]:
    """Copy every checkpoint tensor under `prefix` into `model`; return the set of keys consumed.

    Tensors are read one at a time through `reader.get`, cast to the parameter's dtype and copied
    into it (on the parameter's device). Raises `WeightError` naming the key for a missing tensor,
    an unexpected tensor under `prefix`, or a shape mismatch. Names are checked before any tensor is
    read; a shape mismatch stops loading at that key (earlier tensors are already copied).
    """
    targets = expected_vision_keys(model, prefix)
    present = {key for key in reader.keys() if key.startswith(prefix)}
    missing = sorted(targets.keys() - present)
    if missing:
        raise WeightError(f"vision weights missing from checkpoint: {_names(missing)}")
    unexpected = sorted(present - targets.keys())
    if unexpected:
        raise WeightError(f"unexpected vision tensors in checkpoint (not in this tower): {_names(unexpected)}")
    with torch.no_grad():
        for key, param in targets.items():
            tensor = reader.get(key)
            if tuple(tensor.shape) != tuple(param.shape):
                raise WeightError(f"shape mismatch for {key}: expected {list(param.shape)}, got {list(tensor.shape)}")
            param.copy_(tensor.to(dtype=param.dtype))
    return set(targets)


def _names(keys: list[str], limit: int = 8) -> str:
    shown = ", ".join(keys[:limit])
    return shown if len(keys) <= limit else f"{shown} ... ({len(keys)} in all)"
