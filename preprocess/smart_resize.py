"""Target sizes for images and videos: sides multiples of `factor`, pixels within a budget."""

from __future__ import annotations

import math

MAX_ASPECT_RATIO = 200


def smart_resize(
    height: int, width: int, factor: int = 32, min_pixels: int = 65536, max_pixels: int = 16777216
) -> tuple[int, int]:
    """Return the (height, width) an image is resized to before patchify.

    Invariants (those of the Qwen image processors, reproduced exactly, rounding included):
      1. both sides are positive multiples of `factor` (patch 16 * merge 2 = 32);
      2. height * width lies in [min_pixels, max_pixels] (the config's `size.shortest_edge` and
         `size.longest_edge`, which are pixel counts), except when a side had to be clamped up to
         `factor` for an extreme aspect ratio;
      3. the aspect ratio is kept as closely as the rounding allows.

    Each side is first rounded to the nearest multiple of `factor` (Python `round`: ties go to
    the even multiple). If that area is over `max_pixels`, both sides are scaled by
    1/sqrt(h*w/max_pixels) and rounded DOWN to multiples of `factor`; if under `min_pixels`,
    scaled by sqrt(min_pixels/(h*w)) and rounded UP.

    Raises ValueError for non-positive sides or an aspect ratio above 200.
    """
    _check_sides(height, width)
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        shrink = math.sqrt(height * width / max_pixels)
        h_bar = max(factor, math.floor(height / shrink / factor) * factor)
        w_bar = max(factor, math.floor(width / shrink / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        grow = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * grow / factor) * factor
        w_bar = math.ceil(width * grow / factor) * factor
    return h_bar, w_bar


def smart_resize_video(
    num_frames: int,
    height: int,
    width: int,
    *,
    temporal_factor: int = 2,
    factor: int = 32,
    min_pixels: int = 4096,
    max_pixels: int = 25165824,
) -> tuple[int, int]:
    """Return the (height, width) every frame of a video is resized to (Qwen3-VL video rule).

    Same invariants as `smart_resize`, but the pixel budget [min_pixels, max_pixels] covers the
    whole clip: the area checked is t_bar * h_bar * w_bar with t_bar = `num_frames` rounded to a
    multiple of `temporal_factor`, and the scale is sqrt(num_frames * h * w / budget). Frames with
    a side under `factor` are first scaled up (truncating to int) so the short side is `factor`.

    Raises ValueError when `num_frames` < `temporal_factor`, for non-positive sides, or for an
    aspect ratio above 200.
    """
    if num_frames < temporal_factor:
        raise ValueError(f"a video needs at least {temporal_factor} frames, got {num_frames}")
    if height <= 0 or width <= 0:
        raise ValueError(f"frame sides must be positive, got width {width}, height {height}")
    if height < factor or width < factor:
        up = max(factor / height, factor / width)
        height, width = int(height * up), int(width * up)
    _check_sides(height, width)
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    t_bar = round(num_frames / temporal_factor) * temporal_factor
    if t_bar * h_bar * w_bar > max_pixels:
        shrink = math.sqrt(num_frames * height * width / max_pixels)
        h_bar = max(factor, math.floor(height / shrink / factor) * factor)
        w_bar = max(factor, math.floor(width / shrink / factor) * factor)
    elif t_bar * h_bar * w_bar < min_pixels:
        grow = math.sqrt(min_pixels / (num_frames * height * width))
        h_bar = math.ceil(height * grow / factor) * factor
        w_bar = math.ceil(width * grow / factor) * factor
    return h_bar, w_bar


def _check_sides(height: int, width: int) -> None:
    if height <= 0 or width <= 0:
        raise ValueError(f"image sides must be positive, got width {width}, height {height}")
    ratio = max(height, width) / min(height, width)
    if ratio > MAX_ASPECT_RATIO:
        raise ValueError(f"aspect ratio {ratio:.1f} of a {width}x{height} (width x height) image is over the "
                         f"supported maximum of {MAX_ASPECT_RATIO}")
