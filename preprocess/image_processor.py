"""Images to patches: load, smart-resize, normalise, patchify."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np
import torch
from PIL import Image

from .config import IMAGE_PIXELS, PreprocessConfig, read_preprocessor_json
from .image_load import ImageSource, load_image
from .inputs import VisualInputs
from .patchify import normalize, patchify, pil_backend_lut, torch_backend_lut
from .smart_resize import smart_resize
from .video_resize import resize_frames

BACKENDS = ("pil", "torchvision")


class ImageProcessor:
    """Images to `VisualInputs`, equal to a transformers Qwen2-VL image processor on the same RGB image.

    backend="pil" (default): equal to `Qwen2VLImageProcessorPil` (PIL bicubic resize on uint8).
    backend="torchvision": equal to `Qwen2VLImageProcessor`, the class `AutoImageProcessor` picks
    for the published checkpoints when torchvision is installed (antialiased torch bicubic on
    uint8). The two resizes differ by a few levels on some pixels; everything else is shared.
    """

    def __init__(self, config: PreprocessConfig | None = None, backend: str = "pil"):
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        self.config = config or PreprocessConfig(*IMAGE_PIXELS)
        self.backend = backend
        c = self.config
        make_lut = pil_backend_lut if backend == "pil" else torch_backend_lut
        self._lut = make_lut(c.image_mean, c.image_std, c.rescale_factor)  # [3, 256] float32

    @classmethod
    def from_pretrained(cls, path: str | Path, backend: str = "pil") -> "ImageProcessor":
        """Read `preprocessor_config.json` of a checkpoint directory (published defaults when absent)."""
        raw = read_preprocessor_json(path, "preprocessor_config.json", "image_processor")
        return cls(PreprocessConfig.from_dict(raw, default_pixels=IMAGE_PIXELS), backend)

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
        if self.backend == "pil" and (width, height) != image.size:
            image = image.resize((width, height), resample=c.resample)  # uint8 resize, like the reference
        pixels = torch.from_numpy(np.array(image)).permute(2, 0, 1).contiguous()  # [3, H, W] uint8
        if self.backend == "torchvision":
            pixels = resize_frames(pixels[None], height, width, c.resample)[0]
        pixels = normalize(pixels, self._lut)  # [3, h, w] float32
        frames = pixels[None].expand(c.temporal_patch_size, -1, -1, -1)  # image repeated: [2, 3, h, w]
        return patchify(frames, c.patch_size, c.merge_size, c.temporal_patch_size)
