"""ImageProcessor against transformers' Qwen2VLImageProcessorPil: exact equality on the same RGB image."""

import io
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image, ImageOps
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from preprocess import ImageProcessor, VisualInputs, load_image

# The published Qwen3.5 preprocessor_config.json.
CONFIG = {"size": {"longest_edge": 16777216, "shortest_edge": 65536}, "patch_size": 16, "temporal_patch_size": 2,
          "merge_size": 2, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
          "processor_class": "Qwen3VLProcessor", "image_processor_type": "Qwen2VLImageProcessorFast"}

SIZES = [(1, 1), (10, 300), (48, 64), (224, 224), (333, 500), (1080, 1920), (32, 6000), (6000, 31),
         (33, 6500), (257, 255), pytest.param((5000, 4000), marks=pytest.mark.slow)]


def _reference(**overrides) -> Qwen2VLImageProcessorPil:
    keys = ("size", "patch_size", "temporal_patch_size", "merge_size", "image_mean", "image_std")
    return Qwen2VLImageProcessorPil(**{**{k: CONFIG[k] for k in keys}, **overrides})


def _random_image(h: int, w: int, seed: int = 0) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8))


def _assert_same(ours: VisualInputs, images: list[Image.Image], reference=None):
    expected = (reference or _reference())(images=images, return_tensors="pt")
    assert ours.grid_thw.dtype == torch.int64 and ours.pixel_values.dtype == torch.float32
    assert torch.equal(ours.grid_thw, expected["image_grid_thw"])
    assert ours.pixel_values.shape == expected["pixel_values"].shape
    assert torch.equal(ours.pixel_values, expected["pixel_values"])  # bit-exact


@pytest.fixture(scope="module")
def processor(tmp_path_factory) -> ImageProcessor:
    checkpoint = tmp_path_factory.mktemp("ckpt")
    (checkpoint / "preprocessor_config.json").write_text(json.dumps(CONFIG))
    return ImageProcessor.from_pretrained(checkpoint)


@pytest.mark.parametrize("size", SIZES, ids=lambda size: f"{size[0]}x{size[1]}")
def test_sizes_match_reference(processor, size):
    image = _random_image(*size)
    _assert_same(processor([image]), [image])


def test_several_images_are_concatenated(processor):
    images = [_random_image(64, 64, 1), _random_image(300, 200, 2), _random_image(17, 900, 3)]
    ours = processor(images)
    _assert_same(ours, images)
    assert ours.pixel_values.shape[0] == int(ours.grid_thw.prod(dim=1).sum()) and len(ours) == 3


def test_converted_modes_match_reference_on_the_same_rgb(processor):
    rng = np.random.default_rng(5)
    rgba = Image.fromarray(rng.integers(0, 256, (90, 120, 4), dtype=np.uint8))
    grey = Image.fromarray(rng.integers(0, 256, (70, 50), dtype=np.uint8))
    palette = _random_image(80, 60, 6).quantize(16)
    palette.info["transparency"] = 3
    for image in (rgba, grey, palette):
        rgb = load_image(image)
        _assert_same(processor([image]), [rgb])
    # the reference converts RGBA by itself in the same way (alpha on white)
    _assert_same(processor([rgba]), [rgba])


def test_exif_rotated_file_matches_reference_on_upright_image(processor, tmp_path: Path):
    exif = Image.Exif()
    exif[0x0112] = 8  # rotate 90 degrees counter-clockwise to display
    path = tmp_path / "rotated.jpg"
    _random_image(120, 300, 7).save(path, "JPEG", exif=exif)
    upright = ImageOps.exif_transpose(Image.open(path)).convert("RGB")
    assert upright.size == (120, 300)
    _assert_same(processor([str(path)]), [upright])


def test_defaults_without_config_and_other_budgets(tmp_path: Path):
    assert ImageProcessor.from_pretrained(tmp_path).config == ImageProcessor().config
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({**CONFIG, "size": {
        "shortest_edge": 32 * 32 * 4, "longest_edge": 32 * 32 * 64}}))
    small = ImageProcessor.from_pretrained(tmp_path)
    image = _random_image(700, 900, 8)
    reference = _reference(size={"shortest_edge": 32 * 32 * 4, "longest_edge": 32 * 32 * 64})
    _assert_same(small([image]), [image], reference)


def test_unsupported_config_is_refused(tmp_path: Path):
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({**CONFIG, "do_normalize": False}))
    with pytest.raises(ValueError, match="do_normalize"):
        ImageProcessor.from_pretrained(tmp_path)
    with pytest.raises(ValueError, match="not found"):
        ImageProcessor.from_pretrained(tmp_path / "nope")


def test_encoded_bytes_round_trip(processor):
    buffer = io.BytesIO()
    _random_image(100, 100, 9).save(buffer, "PNG")
    ours = processor(buffer.getvalue())  # a single image need not be in a list
    _assert_same(ours, [Image.open(io.BytesIO(buffer.getvalue())).convert("RGB")])


@pytest.mark.parametrize("size", [(1, 1), (10, 300), (333, 500), (32, 6000), (1500, 2000)])
def test_torchvision_backend_matches_auto_image_processor_class(size):
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor

    keys = ("size", "patch_size", "temporal_patch_size", "merge_size", "image_mean", "image_std")
    reference = Qwen2VLImageProcessor(**{k: CONFIG[k] for k in keys})
    image = _random_image(*size, seed=11)
    _assert_same(ImageProcessor(backend="torchvision")([image]), [image], reference)
