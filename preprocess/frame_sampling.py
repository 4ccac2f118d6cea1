"""Which frames of a video to keep: pure timestamp arithmetic, no decoding.

Frames are described by their presentation timestamps `pts` (integers in units of `time_base`
seconds, sorted, unique). All comparisons are exact (integers and Fractions), so the choice
does not depend on floating-point rounding.
"""

from __future__ import annotations

import bisect
import math
from fractions import Fraction

import numpy as np


def select_frames(
    pts: np.ndarray,
    time_base: Fraction,
    end_pts: int,
    *,
    fps: float,
    num_frames: int | None,
    min_frames: int,
    max_frames: int,
    start: float | None,
    end: float | None,
    temporal_patch: int = 2,
) -> list[int]:
    """Return indices into `pts` of the frames to sample, in time order.

    Times are measured from the first frame (pts[0] is 0 s); `end_pts` is where the last frame
    ends. The window is [start, end] (default: the whole video); the window's frames are those
    whose time lies inside it.

    Count: `num_frames` if given, else window_seconds * fps clamped to
    [min_frames rounded up, max_frames rounded down] to multiples of `temporal_patch`, then
    rounded down to a multiple of `temporal_patch` (the qwen-vl-utils rule). It is capped at the
    number of frames in the window.

    Targets: that many times evenly spaced from the window's first frame to its last frame
    (inclusive), the way `np.linspace(0, total - 1, n).round()` spaces frame indices in
    transformers' Qwen3VLVideoProcessor. Each target takes the frame whose timestamp is NEAREST;
    an exact tie (possible only for an odd count) goes to the even frame index, like numpy's
    round-half-to-even. For constant-frame-rate video this equals the transformers indices
    (always for an even count; for an odd one, unless numpy's float linspace lands a hair off a
    tie). For variable frame rate it samples by time, not by index, and two targets may pick the
    same frame.

    Padding: if the count is not a multiple of `temporal_patch` (a video with too few frames,
    or an odd `num_frames`) the last index is repeated until it is.
    """
    _check_arguments(fps, num_frames, min_frames, max_frames, start, end)
    rel = [int(p) - int(pts[0]) for p in pts]  # time of each frame in time_base units
    duration = Fraction(end_pts - int(pts[0])) * time_base
    lo_s = Fraction(start) if start is not None else Fraction(0)
    hi_s = min(Fraction(end), duration) if end is not None else duration
    first = bisect.bisect_left(rel, math.ceil(lo_s / time_base))
    last = bisect.bisect_right(rel, math.floor(hi_s / time_base)) - 1
    if first > last:
        raise ValueError(f"no frame between start={start} s and end={end} s "
                         f"(the video's frames span 0 to {float(rel[-1] * time_base):.3f} s)")
    if num_frames is not None:
        count = num_frames
    else:
        count = frame_count(hi_s - lo_s, fps, min_frames, max_frames, temporal_patch)
    count = min(count, last - first + 1)
    indices = [_nearest(rel, target, first, last) for target in _targets(rel[first], rel[last], count)]
    while len(indices) % temporal_patch:
        indices.append(indices[-1])
    return indices


def frame_count(seconds: float | Fraction, fps: float, min_frames: int, max_frames: int,
                temporal_patch: int = 2) -> int:
    """Frames to sample from `seconds` of video at `fps`: clamped, a multiple of `temporal_patch`."""
    low = math.ceil(min_frames / temporal_patch) * temporal_patch
    high = max(temporal_patch, max_frames // temporal_patch * temporal_patch)
    wanted = min(max(Fraction(seconds) * Fraction(fps), low), high)  # exact, no float rounding
    return max(temporal_patch, math.floor(wanted / temporal_patch) * temporal_patch)


def _targets(first: int, last: int, count: int) -> list[Fraction]:
    if count == 1:
        return [Fraction(first)]
    step = Fraction(last - first, count - 1)
    return [first + k * step for k in range(count)]


def _nearest(rel: list[int], target: Fraction, first: int, last: int) -> int:
    """Index in [first, last] of the frame nearest to `target` (ties go to the even index)."""
    after = bisect.bisect_left(rel, target, first, last + 1)  # first frame at or after target
    if after > last:
        return last
    if after == first or rel[after] == target:
        return after
    before = after - 1
    gap_after, gap_before = rel[after] - target, target - rel[before]
    if gap_after == gap_before:  # a tie: the even index, as numpy's round-half-to-even does
        return before if before % 2 == 0 else after
    return after if gap_after < gap_before else before


def _check_arguments(fps: float, num_frames: int | None, min_frames: int, max_frames: int,
                     start: float | None, end: float | None) -> None:
    if num_frames is not None and num_frames < 1:
        raise ValueError(f"num_frames must be at least 1, got {num_frames}")
    if num_frames is None and not fps > 0:
        raise ValueError(f"fps must be positive, got {fps}")
    if min_frames < 1 or max_frames < min_frames:
        raise ValueError(f"need 1 <= min_frames <= max_frames, got min_frames={min_frames}, max_frames={max_frames}")
    if start is not None and start < 0:
        raise ValueError(f"start must be >= 0 seconds, got {start}")
    if start is not None and end is not None and end <= start:
        raise ValueError(f"end ({end} s) must be after start ({start} s)")
