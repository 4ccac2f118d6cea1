"""The pixel budget of one image, or of one video's sampled frames all together.

Media larger than their budget are scaled down while they are decoded (JPEG at 1/2, 1/4 or 1/8
scale by the decoder, other images right after decoding, video frames by FFmpeg before they are
kept), so a small file cannot decode into gigabytes. Media within the budget are decoded exactly
as before. What cannot be scaled down while decoding (a PNG, or one video frame, larger than twice
the budget) is refused with an error that names the option raising the budget.

The default, 2**26 pixels (64 Mi, about 8192 x 8192), is over twice the most pixels the published
image and video processors keep (2**24 per image, 24 Mi per video), so their results do not change.
"""

from __future__ import annotations

import math

DEFAULT_MAX_PIXELS = 1 << 26
HARD_LIMIT_FACTOR = 2  # what is decoded at full size before it can be scaled may be this much over budget
OPTION = "max_pixels (the server's --max-media-pixels)"


def check_budget(max_pixels: int) -> int:
    """`max_pixels` if it is a positive int; ValueError otherwise."""
    if isinstance(max_pixels, bool) or not isinstance(max_pixels, int) or max_pixels < 1:
        raise ValueError(f"max_pixels must be a positive int, got {max_pixels!r}")
    return max_pixels


def fit(width: int, height: int, pixels: int) -> tuple[int, int]:
    """(width, height) scaled down, aspect kept, to at most `pixels` pixels (each side at least 1);
    unchanged when already within."""
    if width * height <= pixels:
        return width, height
    scale = math.sqrt(pixels / (width * height))
    return max(int(width * scale), 1), max(int(height * scale), 1)


def over_limit(what: str, width: int, height: int, max_pixels: int) -> str:
    """The message for media that would decode to more than the hard limit (HARD_LIMIT_FACTOR x budget)."""
    return (f"{what} is {width}x{height} = {width * height} pixels, over the limit of "
            f"{HARD_LIMIT_FACTOR * max_pixels} (twice the pixel budget of {max_pixels}); raise the budget "
            f"with {OPTION}")  # fmt: skip
