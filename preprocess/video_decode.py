"""Decode only the frames we need: seek to the keyframe before sparse targets, read dense ones in one pass."""

from __future__ import annotations

from collections.abc import Iterator

import av
import numpy as np

from .errors import VideoError
from .video_index import StreamIndex

# Start a new seek when that skips more than this many frames; closer targets are reached by
# decoding forward (a seek restarts the decoder, so it pays only when it saves real work).
SEEK_MIN_SKIP = 16


def plan_runs(wanted: list[int], index: StreamIndex) -> list[list[int]]:
    """Split sorted, unique wanted pts into runs; each run is one seek followed by forward decoding.

    A target joins the current run when no keyframe lies between the previous target and it
    (decoding forward is then the only way), or when seeking would skip at most SEEK_MIN_SKIP
    frames. Dense sampling therefore decodes sequentially once; sparse sampling seeks per target.
    """
    runs: list[list[int]] = []
    for pts in wanted:
        if runs:
            previous = runs[-1][-1]
            key = _keyframe_before(index, pts)
            skipped = int(np.searchsorted(index.pts, key) - np.searchsorted(index.pts, previous, "right"))
            if key <= previous or skipped <= SEEK_MIN_SKIP:
                runs[-1].append(pts)
                continue
        runs.append([pts])
    return runs


def _keyframe_before(index: StreamIndex, pts: int) -> int:
    """pts of the last keyframe at or before `pts` (the first keyframe if none is)."""
    position = max(int(np.searchsorted(index.keyframe_pts, pts, "right")) - 1, 0)
    return int(index.keyframe_pts[position])


def decode_frames(container: av.container.InputContainer, stream: av.video.stream.VideoStream,
                  index: StreamIndex, wanted: list[int], name: str,
                  size: tuple[int, int] | None = None) -> Iterator[tuple[int, int, np.ndarray]]:  # fmt: skip
    """Yield (wanted pts, decoded pts, RGB uint8 [H, W, 3] with rotation applied) for each wanted pts.

    The frame returned for a wanted pts is the first decoded frame at or after it (the frame
    itself for an intact file). Only these frames are converted to RGB and held; `size`
    (width, height before rotation) scales them down while converting.
    """
    stream.thread_type = "AUTO"  # FFmpeg frame + slice threading
    for run in plan_runs(sorted(set(wanted)), index):
        yield from _decode_run(container, stream, index, run, name, size)


def _decode_run(container, stream, index: StreamIndex, run: list[int], name: str, size: tuple[int, int] | None
                ) -> Iterator[tuple[int, int, np.ndarray]]:
    frames = _seek(container, stream, index, run[0], name)
    position = 0
    try:
        for frame in frames:
            while position < len(run) and frame.pts >= run[position]:
                yield run[position], frame.pts, to_rgb(frame, stream, name, size)
                position += 1
            if position == len(run):
                return
    except av.error.FFmpegError as e:
        raise VideoError(f"{name}: decoding failed near {_seconds(index, run[position])} "
                         f"(corrupt or truncated file: {e})") from e
    finally:
        frames.close()
    raise VideoError(f"{name}: the stream ended before the frame at {_seconds(index, run[position])} "
                     "(truncated or corrupt file)")


def _seek(container, stream, index: StreamIndex, target: int, name: str) -> Iterator[av.VideoFrame]:
    """Position the decoder at the last keyframe at or before `target`; return the frame iterator.

    Demuxers seek by their own index (MP4: decode timestamps), which can land one keyframe late;
    when the first decoded frame is already past `target` we retry from the keyframe before.
    """
    key = int(np.searchsorted(index.keyframe_pts, target, "right")) - 1
    key = max(key, 0)
    while True:
        try:
            container.seek(int(index.keyframe_pts[key]), stream=stream, backward=True, any_frame=False)
            frames = _frames(container, stream)
            first = next(frames, None)
        except av.error.FFmpegError as e:
            raise VideoError(f"{name}: seeking to {_seconds(index, target)} failed ({e})") from e
        if first is None:
            raise VideoError(f"{name}: no frame could be decoded after {_seconds(index, target)} "
                             "(truncated or corrupt file)")
        if first.pts <= target or key == 0:
            return _prepend(first, frames)
        frames.close()
        key -= 1


def _frames(container, stream) -> Iterator[av.VideoFrame]:
    for frame in container.decode(stream):
        if frame.pts is not None:
            yield frame


def _prepend(first: av.VideoFrame, rest: Iterator[av.VideoFrame]) -> Iterator[av.VideoFrame]:
    try:
        yield first
        yield from rest
    finally:
        rest.close()


def to_rgb(frame: av.VideoFrame, stream, name: str, size: tuple[int, int] | None = None) -> np.ndarray:
    """RGB uint8 [H, W, 3] of a decoded frame (scaled to `size`, (width, height), by area averaging
    when given), turned upright by the stream's rotation."""
    if size is None:
        rgb = frame.to_ndarray(format="rgb24")  # [H, W, 3]
    else:
        rgb = frame.to_ndarray(format="rgb24", width=size[0], height=size[1], interpolation="AREA")
    turns = rotation_turns(frame, stream, name)
    return np.ascontiguousarray(np.rot90(rgb, turns)) if turns else rgb


def rotation_turns(frame: av.VideoFrame, stream, name: str) -> int:
    """Counter-clockwise quarter turns that make the frame upright.

    From the display matrix (PyAV's `frame.rotation`, counter-clockwise degrees), else from an
    old-style "rotate" stream tag (any case; clockwise degrees). Mirroring in the matrix is not
    applied.
    """
    degrees = frame.rotation
    tag = next((value for key, value in stream.metadata.items() if key.lower() == "rotate"), None)
    if not degrees and tag:
        try:
            degrees = -round(float(tag))
        except ValueError as e:
            raise VideoError(f"{name}: unreadable rotate tag {tag!r}") from e
    if degrees % 90:
        raise VideoError(f"{name}: rotation of {degrees} degrees is not a multiple of 90; not supported")
    return (degrees // 90) % 4


def _seconds(index: StreamIndex, pts: int) -> str:
    return f"{float((pts - int(index.pts[0])) * index.time_base):.3f} s"
