"""The tensors preprocess/ hands to the vision tower."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class VisualInputs:
    """Flattened patches of one or more images or videos.

    pixel_values: float32 [N, C * temporal_patch * patch * patch] (3 * 2 * 16 * 16 = 1536), the
        patches of every item one after another; within an item, rows go frame group by frame
        group, and within a group the 2x2 patches of each merge window are contiguous.
    grid_thw: int64 [num_items, 3], the (t, h, w) patch grid of each item; N = sum of t * h * w.
    """

    pixel_values: torch.Tensor
    grid_thw: torch.Tensor

    def __len__(self) -> int:
        return self.grid_thw.shape[0]
