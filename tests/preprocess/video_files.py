"""Small test videos encoded with PyAV, each frame's index painted into its pixels.

The index is written as 8 bits, one 8-pixel-wide column of the top half per bit (black 0,
white 1); the bottom half is mid-grey, so the orientation is visible too. Blocks this large
survive lossy compression, so `read_index` recovers the source frame after decoding.
"""

from __future__ import annotations

from fractions import Fraction
from pathlib import Path

import av
import numpy as np

WIDTH, HEIGHT = 64, 48
BITS = 8


def codec() -> str:
    return "libx264" if "libx264" in av.codecs_available else "mpeg4"


def paint(index: int, width: int = WIDTH, height: int = HEIGHT) -> np.ndarray:
    """RGB uint8 [H, W, 3] frame carrying `index` (0..255) in its top half."""
    frame = np.full((height, width, 3), 128, dtype=np.uint8)
    block = width // BITS
    for bit in range(BITS):
        frame[: height // 2, bit * block:(bit + 1) * block] = 255 if (index >> bit) & 1 else 0
    return frame


def read_index(frame: np.ndarray) -> int:
    """The index painted by `paint` into an upright frame [H, W, 3]."""
    height, width = frame.shape[:2]
    block = width // BITS
    top = frame[2: height // 2 - 2].astype(np.float32).mean(axis=(0, 2))  # [W]
    return sum(1 << bit for bit in range(BITS) if top[bit * block + 2:(bit + 1) * block - 2].mean() > 128)


def encode(path: Path, count: int, *, fps: int = 10, gop: int = 10, pts_ms: list[int] | None = None,
           rotation: int | None = None, rotate_tag: str | None = None, container_format: str | None = None,
           movflags: str | None = None) -> Path:
    """Write `count` painted frames; `pts_ms` gives explicit millisecond timestamps (variable rate).

    `rotation`: display matrix, counter-clockwise degrees; `rotate_tag`: an old-style "rotate"
    stream tag (clockwise degrees), which only some containers (MKV) keep.
    """
    options = {"movflags": movflags} if movflags else {}
    with av.open(str(path), "w", format=container_format, options=options) as out:
        stream = out.add_stream(codec(), rate=fps)
        stream.width, stream.height, stream.pix_fmt = WIDTH, HEIGHT, "yuv420p"
        stream.codec_context.gop_size = gop
        stream.options = {"bf": "2"} if codec() == "libx264" else {}
        if pts_ms is not None:
            stream.time_base = stream.codec_context.time_base = Fraction(1, 1000)
        if rotation is not None:
            stream.set_display_rotation(rotation)
        if rotate_tag is not None:
            stream.metadata["rotate"] = rotate_tag
        for i in range(count):
            frame = av.VideoFrame.from_ndarray(paint(i), format="rgb24")
            if pts_ms is not None:
                frame.pts, frame.time_base = pts_ms[i], Fraction(1, 1000)
            out.mux(stream.encode(frame))
        out.mux(stream.encode())
    return path


def encode_audio_only(path: Path) -> Path:
    """A short AAC file with no video stream."""
    with av.open(str(path), "w") as out:
        stream = out.add_stream("aac", rate=16000)
        for i in range(8):
            frame = av.AudioFrame.from_ndarray(np.zeros((1, 1024), np.float32), format="fltp", layout="mono")
            frame.sample_rate, frame.pts = 16000, i * 1024
            out.mux(stream.encode(frame))
        out.mux(stream.encode())
    return path


def encode_no_frames(path: Path) -> Path:
    """An AVI file whose header declares a video stream but which holds no frame."""
    with av.open(str(path), "w", format="avi") as out:
        stream = out.add_stream("mpeg4", rate=10)
        stream.width, stream.height, stream.pix_fmt = WIDTH, HEIGHT, "yuv420p"
        out.start_encoding()
    return path
