"""Typed preprocessing config read from `preprocessor_config.json` / `video_preprocessor_config.json`."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

# Values of the published Qwen3.5 / Qwen3.6 files; used when a key is absent.
IMAGE_PIXELS = (65536, 16777216)  # size.shortest_edge, size.longest_edge (pixel counts)
VIDEO_PIXELS = (4096, 25165824)


@dataclass(frozen=True)
class PreprocessConfig:
    """Preprocessing settings shared by images and videos; the video-only fields are ignored for images."""

    min_pixels: int
    max_pixels: int
    patch_size: int = 16
    temporal_patch_size: int = 2
    merge_size: int = 2
    image_mean: tuple[float, ...] = (0.5, 0.5, 0.5)
    image_std: tuple[float, ...] = (0.5, 0.5, 0.5)
    rescale_factor: float = 1 / 255
    resample: int = 3  # PIL.Image.Resampling.BICUBIC
    fps: float = 2.0
    min_frames: int = 4
    max_frames: int = 768
    cap_pixels_per_frame: bool = False
    max_video_tokens: int = 768

    @property
    def factor(self) -> int:
        """Side granularity in pixels: one merged token covers factor x factor pixels."""
        return self.patch_size * self.merge_size

    @classmethod
    def from_dict(cls, raw: dict[str, Any], *, default_pixels: tuple[int, int]) -> "PreprocessConfig":
        """Build from a HF preprocessor dict; absent keys take the published defaults."""
        for flag in ("do_resize", "do_rescale", "do_normalize"):
            if raw.get(flag, True) is False:
                raise ValueError(f"preprocessor config sets {flag}=false, which this pipeline does not support")
        size = dict(raw.get("size") or {})
        if "height" in size or "width" in size:
            raise ValueError(f"fixed-size resizing (size={size}) is not supported; expected shortest_edge/longest_edge")
        min_pixels = raw.get("min_pixels") or size.get("shortest_edge") or default_pixels[0]
        max_pixels = raw.get("max_pixels") or size.get("longest_edge") or default_pixels[1]
        known = {f.name for f in fields(cls)} - {"min_pixels", "max_pixels"}
        values = {k: raw[k] for k in known if raw.get(k) is not None}
        for key in ("image_mean", "image_std"):
            if key in values:
                values[key] = _per_channel(key, values[key])
        config = cls(min_pixels=int(min_pixels), max_pixels=int(max_pixels), **values)
        if config.min_pixels > config.max_pixels:
            raise ValueError(f"min_pixels {config.min_pixels} is larger than max_pixels {config.max_pixels}")
        return config


def _per_channel(key: str, value: Any) -> tuple[float, ...]:
    values = (float(value),) * 3 if isinstance(value, (int, float)) else tuple(float(v) for v in value)
    if len(values) != 3:
        raise ValueError(f"{key} must have 3 values (RGB), got {value!r}")
    return values


def read_preprocessor_json(path: str | Path, filename: str, section: str) -> dict[str, Any]:
    """Return the preprocessor dict of checkpoint `path` ({} when the checkpoint has none).

    `path` is a checkpoint directory (reads `filename`, else the `section` of a combined
    `processor_config.json`) or a JSON file.
    """
    path = Path(path)
    if path.is_file():
        return _read_json(path)
    if not path.is_dir():
        raise ValueError(f"checkpoint path not found: {path}")
    if (path / filename).is_file():
        return _read_json(path / filename)
    combined = path / "processor_config.json"
    if combined.is_file():
        return dict(_read_json(combined).get(section) or {})
    return {}


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read preprocessor config {path}: {e}") from e
    if not isinstance(data, dict):
        raise ValueError(f"preprocessor config {path} is not a JSON object")
    return data
