"""Images to patches: load, smart-resize (PIL bicubic on uint8), normalise, patchify."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np
import torch
from PIL import Image

from .config import IMAGE_PIXELS, PreprocessConfig, read_preprocessor_json
from .image_load import ImageSource, load_image
from .inputs import VisualInputs
from .patchify import normalize, patchify, pil_backend_lut
from .smart_resize import smart_resize


class ImageProcessor:
    """Equal to transformers' `Qwen2VLImageProcessorPil` (the PIL backend) for the same RGB image."""

    def __init__(self, config: PreprocessConfig | None = None):
        self.config = config or PreprocessConfig(*IMAGE_PIXELS)
        c = self.config
        self._lut = pil_backend_lut(c.image_mean, c.image_std, c.rescale_factor)  # [3, 256] float32 numpy

    @classmethod
    def from_pretrained(cls, path: str | Path) -> "ImageProcessor":
        """Read `preprocessor_config.json` of a checkpoint directory (published defaults when absent)."""
        raw = read_preprocessor_json(path, "preprocessor_config.json", "image_processor")
        return cls(PreprocessConfig.from_dict(raw, default_pixels=IMAGE_PIXELS))

    def target_size(self, height: int, width: int) -> tuple[int, int]:
        """(height, width) an image of this size is resized to."""
        c = self.config
        return smart_resize(height, width, c.factor, c.min_pixels, c.max_pixels)

    def __call__(self, images: ImageSource | Sequence[ImageSource]) -> VisualInputs:
        """Preprocess one image or a list of images (anything `load_image` accepts)."""
        if not isinstance(images, (list, tuple)):
            images = [images]
        if not images:
            raise ValueError("no images given")
        patches, grids = [], []
        for image in images:
            rows, grid = self.patchify_image(load_image(image))
            patches.append(rows)
            grids.append(grid)
        return VisualInputs(pixel_values=torch.cat(patches), grid_thw=torch.tensor(grids, dtype=torch.int64))

    def patchify_image(self, image: Image.Image) -> tuple[torch.Tensor, tuple[int, int, int]]:
        """One RGB image to float32 patches [h*w, 3*2*16*16] and its grid (1, h, w)."""
        if image.mode != "RGB":
            raise ValueError(f"expected an RGB image, got mode {image.mode} (use load_image first)")
        c = self.config
        height, width = self.target_size(image.height, image.width)
        if (width, height) != image.size:
            image = image.resize((width, height), resample=c.resample)  # uint8 resize, like the reference
        pixels = normalize(torch.from_numpy(np.array(image)).permute(2, 0, 1), self._lut)  # [3, H, W] float32
        frames = pixels[None].expand(c.temporal_patch_size, -1, -1, -1)  # image repeated: [2, 3, H, W]
        return patchify(frames, c.patch_size, c.merge_size, c.temporal_patch_size)
