"""Which files are images and which are videos, by file name extension."""

from __future__ import annotations

from pathlib import Path

VIDEO_EXTENSIONS = frozenset({".mp4", ".m4v", ".mov", ".mkv", ".webm", ".avi", ".mpg", ".mpeg", ".ts", ".flv",
                              ".wmv", ".3gp", ".ogv"})  # fmt: skip
IMAGE_EXTENSIONS = frozenset({".png", ".jpg", ".jpeg", ".webp", ".bmp", ".gif", ".tif", ".tiff"})


def is_video(path: str | Path) -> bool:
    return Path(path).suffix.lower() in VIDEO_EXTENSIONS


def media_kind(path: str | Path) -> str:
    """"image" or "video" for a file name; ValueError naming the file for any other extension."""
    suffix = Path(path).suffix.lower()
    if suffix in VIDEO_EXTENSIONS:
        return "video"
    if suffix in IMAGE_EXTENSIONS:
        return "image"
    known = ", ".join(sorted(IMAGE_EXTENSIONS | VIDEO_EXTENSIONS))
    raise ValueError(f"{Path(path).name}: not an image or video file name (extensions: {known})")
