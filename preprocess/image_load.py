"""Load an image from any supported source into an upright RGB PIL image."""

from __future__ import annotations

import base64
import binascii
import io
import math
import os
import urllib.error
import urllib.parse
import urllib.request
import warnings
from pathlib import Path
from typing import Union

import numpy as np
from PIL import Image, ImageOps

from .budget import DEFAULT_MAX_PIXELS, HARD_LIMIT_FACTOR, check_budget, fit, over_limit
from .errors import ImageError

# Pillow itself warns above 89M pixels and refuses above 179M; our hard limit (twice the pixel
# budget: 2**27 = 134M pixels by default) sits between, so Pillow's warning is muted here.

ImageSource = Union[str, os.PathLike, bytes, bytearray, memoryview, Image.Image, np.ndarray]

_SIXTEEN_BIT_MODES = ("I;16", "I;16B", "I;16L", "I;16N", "I")


def load_image(
    source: ImageSource, *, max_pixels: int = DEFAULT_MAX_PIXELS, timeout: float = 30.0
) -> Image.Image:
    """Return `source` as an upright RGB PIL image.

    Sources: a path (str or pathlib), a `file://` or `http(s)://` URL, raw encoded bytes, a
    base64 data URI (`data:image/png;base64,...`), a PIL image, or a uint8 numpy array
    [H, W], [H, W, 1], [H, W, 3] or [H, W, 4].

    EXIF orientation is applied. Transparency (RGBA, LA, PA, palette with a transparent colour,
    4-channel arrays) is composited onto white. 16-bit and 32-bit integer greys ("I;16", "I") are
    scaled from 0..65535 to 0..255; float greys ("F") are clipped to 0..255. Other modes (L, 1,
    P, CMYK, YCbCr, ...) use Pillow's conversion to RGB.

    `max_pixels` is the pixel budget of an encoded image (preprocess/budget.py): one larger is
    scaled down to fit it while decoding (JPEG by the decoder's 1/2, 1/4, 1/8 scales, then any
    format right after decoding, bicubic, before any other copy); one that would still decode to
    more than twice the budget is refused before decoding. Images in memory (PIL, arrays) are
    taken as they are.
    Raises `ImageError` naming the source for missing, empty, corrupt, unknown-format or
    oversized images and failed downloads.
    """
    if isinstance(source, Image.Image):
        return _upright_rgb(source, "PIL image")
    if isinstance(source, np.ndarray):
        return _upright_rgb(_from_array(source), f"array {source.shape}")
    check_budget(max_pixels)
    if isinstance(source, (bytes, bytearray, memoryview)):
        data = bytes(source)
        return _decode(data, f"<{len(data)} bytes>", max_pixels)
    if isinstance(source, os.PathLike):
        return _decode_file(Path(source), max_pixels)
    if isinstance(source, str):
        return _load_string(source, max_pixels, timeout)
    raise ImageError(f"unsupported image source type {type(source).__name__}: expected a path, URL, "
                     "bytes, data URI, PIL image or uint8 numpy array")


def _load_string(source: str, max_pixels: int, timeout: float) -> Image.Image:
    if source.startswith("data:"):
        return _decode(_data_uri_bytes(source), f"data URI ({len(source)} chars)", max_pixels)
    if source.startswith(("http://", "https://")):
        return _decode(_download(source, timeout), source, max_pixels)
    if source.startswith("file://"):
        parsed = urllib.parse.urlparse(source)
        if parsed.netloc not in ("", "localhost"):
            raise ImageError(f"{source}: file:// URLs on remote hosts are not supported")
        return _decode_file(Path(urllib.request.url2pathname(parsed.path)), max_pixels)
    return _decode_file(Path(source), max_pixels)


def _data_uri_bytes(uri: str) -> bytes:
    header, sep, payload = uri.partition(",")
    if not sep:
        raise ImageError(f"data URI ({len(uri)} chars): missing ',' between header and data")
    if not header.endswith(";base64"):
        raise ImageError(f"data URI header {header!r}: only base64 data URIs are supported")
    try:
        return base64.b64decode(payload, validate=False)
    except (binascii.Error, ValueError) as e:
        raise ImageError(f"data URI ({len(uri)} chars): invalid base64 data ({e})") from e


def _download(url: str, timeout: float) -> bytes:
    request = urllib.request.Request(url, headers={"User-Agent": "qwen35-vl-preprocess"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.read()
    except urllib.error.HTTPError as e:
        raise ImageError(f"could not download image {url}: HTTP {e.code} {e.reason}") from e
    except (urllib.error.URLError, TimeoutError, OSError) as e:
        reason = getattr(e, "reason", e)
        raise ImageError(f"could not download image {url}: {reason}") from e


def _decode_file(path: Path, max_pixels: int) -> Image.Image:
    name = str(path) if len(str(path)) <= 200 else str(path)[:200] + "..."
    try:
        if not path.exists():
            raise ImageError(f"image file not found: {name}")
        if not path.is_file():
            raise ImageError(f"image path is not a file: {name}")
        data = path.read_bytes()
    except OSError as e:  # e.g. a name too long for the file system, or no permission
        raise ImageError(f"cannot read image file {name}: {e.strerror or e}") from e
    return _decode(data, name, max_pixels)


def _decode(data: bytes, name: str, max_pixels: int) -> Image.Image:
    """Decode encoded image bytes within the pixel budget `max_pixels` (see `load_image`)."""
    if not data:
        raise ImageError(f"{name}: image data is empty")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data))
        if image.width * image.height > max_pixels:
            # JPEG: decode at the smallest DCT scale at least half the budget (so under twice it)
            image.draft(image.mode, fit(image.width, image.height, max(max_pixels // 2, 1)))
        if image.width * image.height > HARD_LIMIT_FACTOR * max_pixels:
            raise ImageError(f"{name}: {over_limit('the image', image.width, image.height, max_pixels)}")
        image.load()
    except ImageError:
        raise
    except Image.DecompressionBombError as e:
        raise ImageError(f"{name}: refused as a decompression bomb by Pillow ({e})") from e
    except Image.UnidentifiedImageError as e:
        raise ImageError(f"{name}: not a recognised image format") from e
    except (OSError, SyntaxError, ValueError, EOFError) as e:
        raise ImageError(f"{name}: corrupt or truncated image ({e})") from e
    return _upright_rgb(_shrink(image, max_pixels), name, owned=True)


def _shrink(image: Image.Image, max_pixels: int) -> Image.Image:
    """A decoded image over `max_pixels` box-reduced by the smallest whole factor that fits it (no
    large intermediate); palette and bilevel images become RGB first, 16-bit greys are resized."""
    if image.width * image.height <= max_pixels:
        return image
    if image.mode in ("1", "P", "PA"):  # Pillow reduces these by nearest neighbour
        image = _to_rgb(image)
    factor = math.ceil(math.sqrt(image.width * image.height / max_pixels))
    while -(-image.width // factor) * -(-image.height // factor) > max_pixels:  # reduce rounds sides up
        factor += 1
    if image.mode.startswith("I;16"):  # Pillow cannot reduce these
        return image.resize(fit(image.width, image.height, max_pixels), Image.Resampling.BICUBIC)
    return image.reduce(factor)


def _from_array(array: np.ndarray) -> Image.Image:
    if array.dtype != np.uint8:
        raise ImageError(f"array {array.shape}: expected dtype uint8, got {array.dtype}")
    if array.ndim == 3 and array.shape[2] == 1:
        array = array[:, :, 0]
    if array.ndim == 2:
        return Image.fromarray(np.ascontiguousarray(array))  # mode L
    if array.ndim == 3 and array.shape[2] in (3, 4):
        return Image.fromarray(np.ascontiguousarray(array))  # mode RGB or RGBA
    raise ImageError(f"array {array.shape}: expected [H, W] or [H, W, C] with C in (1, 3, 4)")


def _upright_rgb(image: Image.Image, name: str, *, owned: bool = False) -> Image.Image:
    """`image` turned upright by its EXIF orientation, as RGB; an `owned` image (decoded here) is
    turned in place rather than copied."""
    try:
        if owned:
            ImageOps.exif_transpose(image, in_place=True)
        else:
            image = ImageOps.exif_transpose(image)
    except (OSError, SyntaxError, ValueError, TypeError) as e:
        raise ImageError(f"{name}: invalid EXIF orientation data ({e})") from e
    try:
        return _to_rgb(image)
    except ValueError as e:
        raise ImageError(f"{name}: cannot convert mode {image.mode} to RGB ({e})") from e


def _to_rgb(image: Image.Image) -> Image.Image:
    if image.mode == "RGB":
        return image
    bands = image.getbands()
    if "A" in bands or "a" in bands or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")  # palette transparency becomes alpha here
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    if image.mode in _SIXTEEN_BIT_MODES:
        wide = np.clip(np.asarray(image).astype(np.int64), 0, 65535)
        grey = ((wide * 255 + 32767) // 65535).astype(np.uint8)  # round(v * 255 / 65535)
        return Image.fromarray(grey).convert("RGB")
    if image.mode == "F":
        grey = np.clip(np.rint(np.asarray(image)), 0, 255).astype(np.uint8)
        return Image.fromarray(grey).convert("RGB")
    return image.convert("RGB")
