"""Fixtures of the front-end tests: the built-in default model (real, random weights) and media files."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from app import default_model_path
from mm import Pipeline
from tests.preprocess.video_files import encode


@pytest.fixture(scope="session")
def pipeline() -> Pipeline:
    return Pipeline.from_pretrained(default_model_path())


def write_image(path: Path, seed: int = 0) -> Path:
    """A small RGB PNG of random colour blocks."""
    blocks = np.random.default_rng(seed).integers(0, 256, (6, 8, 3), dtype=np.uint8)
    Image.fromarray(blocks).resize((96, 72), Image.NEAREST).save(path)
    return path


def write_videos(folder: Path, count: int, *, start: int = 0) -> list[Path]:
    """`count` tiny mp4 videos (64x48, 8-12 frames at 4 fps)."""
    folder.mkdir(parents=True, exist_ok=True)
    return [encode(folder / f"clip{i:02d}.mp4", 8 + i % 5, fps=4) for i in range(start, start + count)]


@pytest.fixture(scope="session")
def media(tmp_path_factory) -> dict[str, Path]:
    """image.png, clip.mp4 and corrupt.mp4 (not a video)."""
    root = tmp_path_factory.mktemp("media")
    [video] = write_videos(root, 1)
    corrupt = root / "corrupt.mp4"
    corrupt.write_bytes(b"this is not a video file " * 40)
    return {"image": write_image(root / "image.png"), "video": video, "corrupt": corrupt}


@pytest.fixture(scope="session")
def server(tmp_path_factory, media):
    """`python -m app.serve` on the default model (API key, small limits, local media under the media folder)."""
    from tests.app.serve_helpers import API_KEY, start_server, stop_server

    log = tmp_path_factory.mktemp("serve") / "server.log"
    args = ["--api-key", API_KEY, "--max-model-len", "4096", "--allowed-local-media-path", str(media["image"].parent),
            "--max-images", "2", "--max-video-frames", "8", "--max-request-bytes", str(1 << 20),
            "--media-fetch-timeout", "3"]  # fmt: skip
    running = start_server(args, log)
    yield running
    stop_server(running)
