"""Normalisation lookup tables and the patch layout shared by images and videos."""

from __future__ import annotations

import numpy as np
import torch


def pil_backend_lut(mean: tuple[float, ...], std: tuple[float, ...], rescale_factor: float) -> np.ndarray:
    """Normalised value of every uint8 level, per channel: float32 [C, 256].

    Same operations, in the same precision, as transformers' PIL-backend image processors:
    x.astype(float64) * rescale_factor, cast to float32, then (x - mean) / std in float32.
    """
    levels = (np.arange(256, dtype=np.uint8).astype(np.float64) * rescale_factor).astype(np.float32)
    mean32, std32 = np.asarray(mean, dtype=np.float32), np.asarray(std, dtype=np.float32)
    return (levels[None, :] - mean32[:, None]) / std32[:, None]


def torch_backend_lut(mean: tuple[float, ...], std: tuple[float, ...], rescale_factor: float) -> np.ndarray:
    """Normalised value of every uint8 level, per channel: float32 [C, 256].

    Same operations as transformers' torchvision-backend (fused rescale + normalise):
    (x.float() - mean * (1 / rescale_factor)) / (std * (1 / rescale_factor)) in float32.
    """
    mean_t = torch.tensor(mean) * (1.0 / rescale_factor)
    std_t = torch.tensor(std) * (1.0 / rescale_factor)
    levels = torch.arange(256, dtype=torch.uint8).to(torch.float32)
    return ((levels[None, :] - mean_t[:, None]) / std_t[:, None]).numpy()


def patchify(frames: torch.Tensor, patch_size: int, merge_size: int, temporal_patch_size: int
             ) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """Cut frames [T, C, H, W] into patches [t*h*w, C*temporal*P*P] and return the grid (t, h, w).

    Row order: frame group, then merge window (row-major over the h/m x w/m windows), then the
    m x m patches inside the window (row-major). Column order: channel, frame in group, patch
    row, patch column. This is the layout of transformers' Qwen2-VL / Qwen3-VL processors.
    T is padded to a multiple of `temporal_patch_size` by repeating the last frame; H and W must
    be multiples of patch_size * merge_size.
    """
    num_frames, channels, height, width = frames.shape
    unit = patch_size * merge_size
    if height % unit or width % unit:
        raise ValueError(f"frame size {height}x{width} is not a multiple of {unit}")
    if pad := -num_frames % temporal_patch_size:
        frames = torch.cat([frames, frames[-1:].expand(pad, -1, -1, -1)])
    grid_t = frames.shape[0] // temporal_patch_size
    grid_h, grid_w = height // patch_size, width // patch_size
    x = frames.reshape(grid_t, temporal_patch_size, channels, grid_h // merge_size, merge_size, patch_size,
                       grid_w // merge_size, merge_size, patch_size)
    x = x.permute(0, 3, 6, 4, 7, 2, 1, 5, 8)  # [t, h/m, w/m, m, m, C, temporal, P, P]
    rows = grid_t * grid_h * grid_w
    return x.reshape(rows, channels * temporal_patch_size * patch_size * patch_size), (grid_t, grid_h, grid_w)


def normalize(pixels: torch.Tensor, lut: np.ndarray) -> torch.Tensor:
    """Map uint8 pixels [..., C, H, W] to float32 through the per-channel table `lut` [C, 256]."""
    if pixels.dtype != torch.uint8:
        raise TypeError(f"expected uint8 pixels, got {pixels.dtype}")
    source = pixels.numpy()
    out = np.empty(source.shape, dtype=np.float32)
    for c in range(lut.shape[0]):
        out[..., c, :, :] = lut[c][source[..., c, :, :]]  # numpy gathers with uint8 indices directly
    return torch.from_numpy(out)
