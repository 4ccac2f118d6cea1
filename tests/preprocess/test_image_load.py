"""load_image: every source kind, EXIF orientation, mode conversions, and clear errors."""

import base64
import io
import zlib
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from preprocess import ImageError, load_image


def _pattern(h: int = 30, w: int = 40) -> np.ndarray:
    rng = np.random.default_rng(h * 1000 + w)
    return rng.integers(0, 256, (h, w, 3), dtype=np.uint8)


def _png(array: np.ndarray, **save) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(array).save(buffer, "PNG", **save)
    return buffer.getvalue()


def test_sources_give_the_same_rgb_image(tmp_path: Path):
    pixels = _pattern()
    path = tmp_path / "a b.png"  # a space, to check file:// URL unquoting
    path.write_bytes(_png(pixels))
    data = path.read_bytes()
    sources = [str(path), path, path.as_uri(), data, bytearray(data),
               "data:image/png;base64," + base64.b64encode(data).decode(), Image.fromarray(pixels), pixels]
    for source in sources:
        image = load_image(source)
        assert image.mode == "RGB" and image.size == (40, 30), type(source)
        np.testing.assert_array_equal(np.asarray(image), pixels)


def test_arrays_with_one_or_four_channels():
    grey = _pattern()[:, :, :1]
    np.testing.assert_array_equal(np.asarray(load_image(grey)), np.repeat(grey, 3, axis=2))
    np.testing.assert_array_equal(np.asarray(load_image(grey[:, :, 0])), np.repeat(grey, 3, axis=2))
    rgba = np.zeros((4, 4, 4), dtype=np.uint8)
    rgba[..., 0] = 200
    rgba[0, 0, 3] = 255  # one opaque red-ish pixel, the rest fully transparent -> white
    out = np.asarray(load_image(rgba))
    assert out[0, 0].tolist() == [200, 0, 0] and out[1, 1].tolist() == [255, 255, 255]
    with pytest.raises(ImageError, match="uint8"):
        load_image(rgba.astype(np.float32))
    with pytest.raises(ImageError, match="C in"):
        load_image(np.zeros((4, 4, 2), dtype=np.uint8))


def test_exif_orientation_is_applied():
    pixels = _pattern(20, 50)
    exif = Image.Exif()
    exif[0x0112] = 6  # "rotate 90 degrees clockwise to display"
    image = load_image(_png(pixels, exif=exif))
    assert image.size == (20, 50)
    np.testing.assert_array_equal(np.asarray(image), np.rot90(pixels, k=-1))
    tagged = Image.open(io.BytesIO(_png(pixels, exif=exif)))  # a PIL image still carrying the tag
    np.testing.assert_array_equal(np.asarray(load_image(tagged)), np.rot90(pixels, k=-1))


def test_transparency_is_composited_on_white():
    rgba = Image.new("RGBA", (2, 1), (0, 0, 0, 0))
    rgba.putpixel((1, 0), (10, 20, 30, 128))
    out = np.asarray(load_image(rgba))
    assert out[0, 0].tolist() == [255, 255, 255]
    assert out[0, 1].tolist() == [132, 137, 142]  # 10*128/255 + 255*127/255, rounded
    la = Image.new("LA", (1, 1), (0, 0))
    assert np.asarray(load_image(la)).tolist() == [[[255, 255, 255]]]
    palette = Image.new("P", (2, 1))
    palette.putpalette([0, 0, 0, 255, 0, 0] + [0] * 762)
    palette.putpixel((1, 0), 1)
    palette.info["transparency"] = 0  # palette entry 0 is transparent
    reloaded = load_image(_pil_png(palette))
    assert np.asarray(reloaded).tolist() == [[[255, 255, 255], [255, 0, 0]]]


def _pil_png(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, "PNG", **({"transparency": image.info["transparency"]} if "transparency" in image.info else {}))
    return buffer.getvalue()


def test_other_modes_become_rgb():
    grey16 = np.array([[0, 257 * 100, 65535]], dtype=np.uint16)
    out = load_image(_pil_png(Image.fromarray(grey16)))
    assert np.asarray(out)[0, :, 0].tolist() == [0, 100, 255]  # 16-bit scaled, not clipped
    assert load_image(Image.new("L", (3, 2), 77)).getpixel((0, 0)) == (77, 77, 77)
    cmyk = Image.new("CMYK", (1, 1), (0, 255, 255, 0))
    assert load_image(cmyk).getpixel((0, 0)) == (255, 0, 0)
    assert load_image(Image.new("1", (1, 1), 1)).getpixel((0, 0)) == (255, 255, 255)
    assert load_image(Image.new("F", (1, 1), 300.0)).getpixel((0, 0)) == (255, 255, 255)


def test_errors_name_the_source(tmp_path: Path):
    with pytest.raises(ImageError, match="not found.*missing.png"):
        load_image(tmp_path / "missing.png")
    empty = tmp_path / "empty.png"
    empty.write_bytes(b"")
    with pytest.raises(ImageError, match="empty.png.*empty"):
        load_image(str(empty))
    text = tmp_path / "notes.jpg"
    text.write_text("not an image at all")
    with pytest.raises(ImageError, match="notes.jpg.*not a recognised image format"):
        load_image(text)
    truncated = tmp_path / "cut.png"
    truncated.write_bytes(_png(_pattern(200, 200))[:3000])
    with pytest.raises(ImageError, match="cut.png.*(corrupt|truncated)"):
        load_image(truncated)
    with pytest.raises(ImageError, match="only base64"):
        load_image("data:image/png,abc")
    with pytest.raises(ImageError, match="unsupported image source type"):
        load_image(12)
    with pytest.raises(ImageError, match="could not download image http://127.0.0.1:9/x.png"):
        load_image("http://127.0.0.1:9/x.png", timeout=5)  # local port 9 (discard): refused, no network


def test_decompression_bomb_is_refused_before_decoding():
    big = _png(np.zeros((300, 400, 3), dtype=np.uint8))
    with pytest.raises(ImageError, match="120000 pixels, over the limit of 100000.*with max_pixels"):
        load_image(big, max_pixels=50_000)
    with pytest.raises(ImageError, match="12000x12000 = 144000000 pixels.*--max-media-pixels"):
        load_image(_forged_png(12000))  # over twice our default budget (2**27), refused from the header alone
    with pytest.raises(ImageError, match="decompression bomb"):
        load_image(_forged_png(20000))  # over Pillow's own hard limit


def _forged_png(side: int) -> bytes:
    """A 1x1 PNG whose header (IHDR, valid CRC) claims side x side pixels."""
    png = _png(np.zeros((1, 1, 3), dtype=np.uint8))
    ihdr = png[12:16] + side.to_bytes(4, "big") * 2 + png[24:29]
    return png[:12] + ihdr + zlib.crc32(ihdr).to_bytes(4, "big") + png[33:]


def test_pixel_budget_scales_down_while_decoding():
    pattern = _pattern(300, 400)
    for fmt, budget in (("PNG", 70_000), ("JPEG", 10_000)):  # PNG after decoding, JPEG by the decoder
        buffer = io.BytesIO()
        image = Image.fromarray(pattern)
        exif = image.getexif()
        exif[0x0112] = 6  # stored sideways: upright is 300 wide, 400 high
        image.save(buffer, fmt, exif=exif.tobytes())
        data = buffer.getvalue()
        full, small = load_image(data), load_image(data, max_pixels=budget)
        assert full.size == (300, 400) and np.array_equal(np.asarray(load_image(data, max_pixels=120_000)),
                                                          np.asarray(full))  # within budget: as before
        assert small.width * small.height <= budget and abs(small.width / small.height - 0.75) < 0.03
    with pytest.raises(ValueError, match="positive int"):
        load_image(data, max_pixels=0)
