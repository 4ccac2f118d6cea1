"""Errors raised by preprocess/: each message names the source (file, URL, ...) and the cause."""


class ImageError(ValueError):
    """An image could not be loaded or converted (missing, empty, corrupt, unknown format, too large)."""


class VideoError(ValueError):
    """A video could not be opened, probed or decoded (missing, empty, not a video, no video stream, truncated)."""
