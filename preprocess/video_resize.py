"""Resize uint8 frames exactly as torchvision's `resize` does for transformers' video processors."""

from __future__ import annotations

import platform

import torch
import torch.nn.functional as F

# PIL resample codes in the configs -> torch interpolation modes we reproduce.
_MODES = {2: "bilinear", 3: "bicubic"}


def check_resample(resample: int) -> str:
    """The torch mode for a config's `resample`; ValueError for modes we do not reproduce."""
    if resample not in _MODES:
        raise ValueError(f"video resample={resample} is not supported (supported: 2 bilinear, 3 bicubic)")
    return _MODES[resample]


def resize_frames(frames: torch.Tensor, height: int, width: int, resample: int = 3) -> torch.Tensor:
    """Resize uint8 frames [T, C, H, W] to [T, C, height, width], antialiased, align_corners=False.

    Mirrors torchvision.transforms.v2.functional.resize on uint8 tensors: an unchanged size is
    returned as is; on CPU, bicubic (and bilinear on AVX2/AVX512/ARM CPUs) runs natively on
    uint8; otherwise it runs in float32, then (bicubic) clamps to [0, 255], rounds and casts back.
    """
    mode = check_resample(resample)
    if frames.dtype != torch.uint8:
        raise TypeError(f"expected uint8 frames, got {frames.dtype}")
    if tuple(frames.shape[-2:]) == (height, width):
        return frames
    if _native_uint8(mode, frames.device):
        return F.interpolate(frames, size=[height, width], mode=mode, align_corners=False, antialias=True)
    out = F.interpolate(frames.float(), size=[height, width], mode=mode, align_corners=False, antialias=True)
    if mode == "bicubic":
        out = out.clamp_(0, 255)
    return out.round_().to(torch.uint8)


def _native_uint8(mode: str, device: torch.device) -> bool:
    if device.type != "cpu":
        return False
    if mode == "bicubic":
        return True
    return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512") or platform.machine() in ("aarch64", "arm64")
