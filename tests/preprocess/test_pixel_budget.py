"""The pixel budget (preprocess/budget.py): media over it are scaled down while decoding, so a small
file cannot decode into gigabytes; within it nothing changes. Peak memory is measured in a subprocess."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import av
import numpy as np
import pytest

from preprocess import VideoError, sample_video
from preprocess.budget import fit

REPO = Path(__file__).resolve().parents[2]


def _one_colour_video(path: Path, width: int, height: int, count: int) -> Path:
    codec = "libx264" if "libx264" in av.codecs_available else "mpeg4"
    with av.open(str(path), "w") as out:
        stream = out.add_stream(codec, rate=8)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        frame = av.VideoFrame.from_ndarray(np.full((height, width, 3), 90, np.uint8), format="rgb24")
        for _ in range(count):
            out.mux(stream.encode(frame))
        out.mux(stream.encode())
    return path


def test_fit_keeps_the_aspect_within_the_budget():
    assert fit(400, 300, 120_000) == (400, 300)
    assert fit(400, 300, 30_000) == (200, 150)
    width, height = fit(3840, 2160, 1_000_000)
    assert width * height <= 1_000_000 and abs(width / height - 16 / 9) < 0.01


def test_video_frames_are_scaled_to_the_budget(tmp_path):
    path = _one_colour_video(tmp_path / "wide.mp4", 640, 360, 8)
    full = sample_video(path, num_frames=8)
    assert full.frames.shape == (8, 360, 640, 3)
    assert np.array_equal(sample_video(path, num_frames=8, max_pixels=8 * 360 * 640).frames, full.frames)
    small = sample_video(path, num_frames=8, max_pixels=8 * 100_000)
    count, height, width, _ = small.frames.shape
    assert count == 8 and height * width <= 100_000 and abs(width / height - 16 / 9) < 0.02
    assert abs(int(small.frames.mean()) - int(full.frames.mean())) <= 2 and small.timestamps == full.timestamps
    with pytest.raises(VideoError, match="a frame is 640x360.*--max-media-pixels"):
        sample_video(path, max_pixels=100_000)  # one frame over twice the budget


_MEASURE = """
import json, resource, sys
from preprocess import ImageProcessor, VideoProcessor, load_image, sample_video
peak = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss >> 10
kind, path = sys.argv[1], sys.argv[2]
data = open(path, "rb").read()
start = peak()
if kind == "image":
    shape = list(ImageProcessor()(load_image(data)).grid_thw[0])
else:
    clip = sample_video(data, num_frames=64)
    shape = list(VideoProcessor()(clip).grid_thw[0])
print(json.dumps({"mb": peak() - start, "grid": [int(v) for v in shape]}))
"""


def _measure(kind: str, path: Path) -> dict:
    run = subprocess.run([sys.executable, "-c", _MEASURE, kind, str(path)], cwd=REPO, capture_output=True,
                         text=True, timeout=300)  # fmt: skip
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.mark.subprocess
@pytest.mark.slow
def test_a_4k_video_of_64_frames_costs_no_gigabytes(tmp_path):
    path = _one_colour_video(tmp_path / "4k.mp4", 3840, 2160, 64)
    assert path.stat().st_size < 200_000
    measured = _measure("video", path)  # at source size the 64 frames alone were 1.6 GB
    assert measured["grid"][0] == 32 and measured["mb"] < 700, measured


@pytest.mark.subprocess
@pytest.mark.slow
def test_an_11500_square_one_colour_png_costs_no_gigabytes(tmp_path):
    import struct
    import zlib

    side, packer = 11500, zlib.compressobj(9)
    row = b"\x00" + b"\x5a" * (3 * side)
    body = b"".join(packer.compress(row) for _ in range(side)) + packer.flush()

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", side, side, 8, 2, 0, 0, 0)
    path = tmp_path / "big.png"
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", body) + chunk(b"IEND", b""))
    measured = _measure("image", path)  # the decode itself is 0.5 GB; was +1.5 GB with the processor
    assert measured["grid"] == [1, 256, 256] and measured["mb"] < 1100, measured
