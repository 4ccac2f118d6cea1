"""Sample frames from a video file (PyAV) or from frames already in memory."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Sequence, Union

import numpy as np
import torch
from PIL import Image

from .budget import DEFAULT_MAX_PIXELS, HARD_LIMIT_FACTOR, check_budget, fit, over_limit
from .errors import VideoError
from .frame_sampling import select_frames
from .video_decode import decode_frames
from .video_index import VideoPath, index_stream, open_video, video_stream

MIN_FRAMES = 4  # default fewest frames a video is sampled to (qwen-vl-utils' FPS_MIN_FRAMES)
FrameList = Union[Sequence[Union[Image.Image, np.ndarray]], np.ndarray, torch.Tensor]
VideoSource = Union[VideoPath, FrameList]


@dataclass
class VideoClip:
    """Frames sampled from a video.

    frames: uint8 numpy [T, H, W, 3], RGB, upright; T is a multiple of 2 (temporal patch).
    timestamps: seconds of each frame from the video's first frame, one per frame.
    source_fps: the source's average frame rate; duration: the source's length in seconds.
    frame_indices: position of each frame among all frames of the source (presentation order).
    """

    frames: np.ndarray
    timestamps: list[float]
    source_fps: float
    duration: float
    frame_indices: list[int] = field(default_factory=list)
    total_frames: int = 0
    source: str | None = None

    def __len__(self) -> int:
        return int(self.frames.shape[0])

    def group_timestamps(self, temporal_patch: int = 2) -> list[float]:
        """Mean timestamp of each group of `temporal_patch` frames (the `<t seconds>` of the prompt)."""
        times = self.timestamps
        return [(times[i] + times[i + temporal_patch - 1]) / 2 for i in range(0, len(times), temporal_patch)]


def sample_video(
    source: VideoSource,
    *,
    fps: float = 2.0,
    num_frames: int | None = None,
    min_frames: int = MIN_FRAMES,
    max_frames: int = 768,
    start: float | None = None,
    end: float | None = None,
    max_pixels: int = DEFAULT_MAX_PIXELS,
) -> VideoClip:
    """Sample frames by timestamp from a video file, or from frames already in memory.

    `source`: a path / `file://` URL / encoded bytes (decoded with PyAV), or a list of frames
    (PIL images or uint8 [H, W, 3] arrays) or a uint8 [T, H, W, 3] array/tensor. Frames in
    memory are taken as a video recorded at `fps` frames per second (frame i at i / fps s), so
    by default all of them are kept (subject to max_frames and the window).

    Which frames (see `frame_sampling.select_frames` for the exact rule): `num_frames` if given,
    else window_seconds * `fps` clamped to [min_frames, max_frames] and rounded down to even;
    targets are evenly spaced from the first to the last frame of the window [start, end]
    (seconds from the first frame) and each takes the frame with the NEAREST timestamp. The
    count is always a multiple of 2: a video with too few frames (or an odd `num_frames`) is
    padded by repeating its last frame. `timestamps` are the chosen frames' own times.

    Decoding: only the chosen frames are converted to RGB and kept (memory bounded by the
    sample); sparse targets are reached by seeking to the keyframe before each, dense ones by
    one sequential pass. Rotation metadata (90/180/270) is applied. `max_pixels` is the pixel budget
    of all chosen frames together (preprocess/budget.py): when T frames of the source's size would
    hold more, FFmpeg scales each frame down (area) to fit before it is kept; a source frame over
    twice the budget is refused. Frames in memory are taken as they are.

    Raises VideoError (naming the file) for missing, empty, non-video, audio-only, frameless or
    truncated files, and ValueError for invalid arguments or a window with no frame.
    """
    options = dict(fps=fps, num_frames=num_frames, min_frames=min_frames, max_frames=max_frames,
                   start=start, end=end)
    if isinstance(source, (str, os.PathLike, bytes, bytearray)):
        return _sample_file(source, options, check_budget(max_pixels))
    return _sample_frames(source, options)


def _sample_file(source: VideoPath, options: dict, max_pixels: int) -> VideoClip:
    name = f"<{len(source)} bytes>" if isinstance(source, (bytes, bytearray)) else os.fspath(source)
    name = name if len(name) <= 200 else name[:200] + "..."
    with open_video(source, name) as container:
        stream = video_stream(container, name)
        index = index_stream(container, stream, name)
        chosen = select_frames(index.pts, index.time_base, index.end_pts, **options)
        wanted = [int(index.pts[i]) for i in chosen]
        size = _decode_size(stream, len(wanted), max_pixels, name)
        frames, decoded_pts = _gather(decode_frames(container, stream, index, wanted, name, size), wanted, name)
    first = int(index.pts[0])
    return VideoClip(
        frames=frames,
        timestamps=[float((p - first) * index.time_base) for p in decoded_pts],
        source_fps=index.average_rate,
        duration=index.duration,
        frame_indices=[int(np.searchsorted(index.pts, p)) for p in decoded_pts],
        total_frames=len(index.pts),
        source=name,
    )


def _decode_size(stream, count: int, max_pixels: int, name: str) -> tuple[int, int] | None:
    """(width, height) to scale each of `count` frames to so that all fit `max_pixels`; None: as decoded."""
    width, height = stream.codec_context.width, stream.codec_context.height
    if width * height > HARD_LIMIT_FACTOR * max_pixels:
        raise VideoError(f"{name}: {over_limit('a frame', width, height, max_pixels)}")
    if count * width * height <= max_pixels:
        return None
    return fit(width, height, max(max_pixels // count, 1))


def _gather(decoded, wanted: list[int], name: str) -> tuple[np.ndarray, list[int]]:
    """Write each decoded frame into every output slot that wants it: uint8 [T, H, W, 3]."""
    slots: dict[int, list[int]] = {}
    for slot, pts in enumerate(wanted):
        slots.setdefault(pts, []).append(slot)
    frames: np.ndarray | None = None
    decoded_pts = list(wanted)
    for pts, actual, rgb in decoded:
        if frames is None:
            frames = np.empty((len(wanted), *rgb.shape), dtype=np.uint8)  # [T, H, W, 3]
        if rgb.shape != frames.shape[1:]:
            raise VideoError(f"{name}: frame size changes mid-stream ({frames.shape[2]}x{frames.shape[1]} "
                             f"to {rgb.shape[1]}x{rgb.shape[0]}); not supported")
        for slot in slots[pts]:
            frames[slot] = rgb
            decoded_pts[slot] = actual
    assert frames is not None  # decode_frames yields every wanted pts or raises
    return frames, decoded_pts


def _sample_frames(source: FrameList, options: dict) -> VideoClip:
    frames = frames_array(source)
    total = frames.shape[0]
    rate = Fraction(options["fps"]).limit_denominator(1_000_000)
    if rate <= 0:
        raise ValueError(f"fps must be positive, got {options['fps']}")
    chosen = select_frames(np.arange(total), 1 / rate, total, **options)
    return VideoClip(
        frames=frames[chosen],
        timestamps=[float(i / rate) for i in chosen],
        source_fps=float(rate),
        duration=float(total / rate),
        frame_indices=list(chosen),
        total_frames=total,
    )


def frames_array(source: FrameList) -> np.ndarray:
    """Frames in memory as uint8 numpy [T, H, W, 3] (PIL images are converted to RGB)."""
    if isinstance(source, torch.Tensor):
        source = source.numpy()
    if isinstance(source, np.ndarray):
        if source.ndim != 4 or source.shape[-1] != 3 or source.dtype != np.uint8:
            raise ValueError(f"expected frames as uint8 [T, H, W, 3], got {source.dtype} {list(source.shape)}")
        if source.shape[0] == 0:
            raise ValueError("the frame array is empty")
        return source
    if not isinstance(source, (list, tuple)) or not source:
        raise ValueError(f"expected a video path or a non-empty list of frames, got {type(source).__name__}")
    arrays = [np.asarray(f.convert("RGB")) if isinstance(f, Image.Image) else np.asarray(f) for f in source]
    shapes = {a.shape for a in arrays}
    if len(shapes) != 1 or any(a.dtype != np.uint8 for a in arrays):
        raise ValueError(f"frames must all be uint8 with one shape [H, W, 3], got shapes {sorted(shapes)}")
    stacked = np.stack(arrays)  # [T, H, W, 3]
    if stacked.ndim != 4 or stacked.shape[-1] != 3:
        raise ValueError(f"frames must be [H, W, 3], got {list(stacked.shape[1:])}")
    return stacked
