"""Videos to patches: resize every frame to one smart size (torch bicubic), normalise, patchify."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence, Union

import numpy as np
import torch
from PIL import Image

from .config import VIDEO_PIXELS, PreprocessConfig, read_preprocessor_json
from .inputs import VisualInputs
from .patchify import normalize, patchify, torch_backend_lut
from .smart_resize import smart_resize_video
from .video import FrameList, VideoClip, frames_array
from .video_resize import check_resample, resize_frames

Video = Union[VideoClip, FrameList]

RESIZE_CHUNK = 16  # frames converted to channel-first and resized at a time


class VideoProcessor:
    """Equal to transformers' `Qwen3VLVideoProcessor` (do_sample_frames=False) on the same frames.

    Sampling settings of the checkpoint (`fps`, `min_frames`, `max_frames`) are kept in
    `config` for callers of `sample_video`; this class does not sample.
    """

    def __init__(self, config: PreprocessConfig | None = None):
        self.config = config or PreprocessConfig(*VIDEO_PIXELS)
        c = self.config
        check_resample(c.resample)
        self._lut = torch_backend_lut(c.image_mean, c.image_std, c.rescale_factor)  # [3, 256] float32

    @classmethod
    def from_pretrained(cls, path: str | Path) -> "VideoProcessor":
        """Read `video_preprocessor_config.json` of a checkpoint directory (published defaults when absent)."""
        raw = read_preprocessor_json(path, "video_preprocessor_config.json", "video_processor")
        return cls(PreprocessConfig.from_dict(raw, default_pixels=VIDEO_PIXELS))

    def target_size(self, num_frames: int, height: int, width: int) -> tuple[int, int]:
        """(height, width) every frame of a `num_frames`-frame video of this size is resized to."""
        c = self.config
        max_pixels = c.max_pixels
        if c.cap_pixels_per_frame:  # qwen-vl-utils' per-frame cap, as transformers applies it
            per_frame = max(min(c.max_video_tokens * c.factor ** 2, c.max_pixels // num_frames),
                            int(c.min_pixels * 1.05))
            max_pixels = per_frame * num_frames
        return smart_resize_video(num_frames, height, width, temporal_factor=c.temporal_patch_size,
                                  factor=c.factor, min_pixels=c.min_pixels, max_pixels=max_pixels)

    def __call__(self, videos: Video | Sequence[Video]) -> VisualInputs:
        """Preprocess one video or a list of videos (VideoClip, uint8 [T, H, W, 3], or a list of frames)."""
        patches, grids = [], []
        for video in _as_list(videos):
            rows, grid = self.patchify_video(video)
            patches.append(rows)
            grids.append(grid)
        return VisualInputs(pixel_values=torch.cat(patches), grid_thw=torch.tensor(grids, dtype=torch.int64))

    def patchify_video(self, video: Video) -> tuple[torch.Tensor, tuple[int, int, int]]:
        """One video to float32 patches [t*h*w, 3*2*16*16] and its grid (t, h, w)."""
        c = self.config
        array = video.frames if isinstance(video, VideoClip) else frames_array(video)  # [T, H, W, 3]
        num_frames, height, width = array.shape[:3]
        target_h, target_w = self.target_size(num_frames, height, width)
        resized = torch.empty((num_frames, 3, target_h, target_w), dtype=torch.uint8)  # [T, 3, h, w]
        for first in range(0, num_frames, RESIZE_CHUNK):  # chunks bound the channel-first copy
            chunk = torch.from_numpy(array[first:first + RESIZE_CHUNK]).permute(0, 3, 1, 2).contiguous()
            resized[first:first + RESIZE_CHUNK] = resize_frames(chunk, target_h, target_w, c.resample)
        return patchify(normalize(resized, self._lut), c.patch_size, c.merge_size, c.temporal_patch_size)


def _as_list(videos) -> list:
    if isinstance(videos, (VideoClip, np.ndarray, torch.Tensor)):
        return [videos]
    if not isinstance(videos, (list, tuple)) or not videos:
        raise ValueError(f"expected a video or a non-empty list of videos, got {type(videos).__name__}")
    first = videos[0]
    if isinstance(first, Image.Image) or (isinstance(first, np.ndarray) and first.ndim == 3):
        return [videos]  # a single video given as a list of frames
    return list(videos)
