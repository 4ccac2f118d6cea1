"""VideoProcessor against transformers' Qwen3VLVideoProcessor (do_sample_frames=False), same frames."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

from preprocess import VideoProcessor, sample_video
from tests.preprocess import video_files

# The published Qwen3.5 video_preprocessor_config.json.
CONFIG = {"size": {"longest_edge": 25165824, "shortest_edge": 4096}, "patch_size": 16, "temporal_patch_size": 2,
          "merge_size": 2, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
          "processor_class": "Qwen3VLProcessor", "video_processor_type": "Qwen3VLVideoProcessor"}

CASES = [(2, 48, 64), (3, 100, 37), (4, 10, 10), (8, 360, 640), (5, 33, 2000), (16, 240, 320), (64, 90, 160)]


def _reference(**overrides) -> Qwen3VLVideoProcessor:
    keys = ("size", "patch_size", "temporal_patch_size", "merge_size", "image_mean", "image_std")
    return Qwen3VLVideoProcessor(**{**{k: CONFIG[k] for k in keys}, **overrides})


def _expected(videos: list[np.ndarray], cap: bool = False, reference=None) -> dict:
    reference = reference or _reference()
    return reference(videos=videos, do_sample_frames=False, cap_pixels_per_frame=cap, return_tensors="pt")


def _random_video(t: int, h: int, w: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (t, h, w, 3), dtype=np.uint8)


@pytest.fixture(scope="module")
def processor(tmp_path_factory) -> VideoProcessor:
    checkpoint = tmp_path_factory.mktemp("ckpt")
    (checkpoint / "video_preprocessor_config.json").write_text(json.dumps(CONFIG))
    return VideoProcessor.from_pretrained(checkpoint)


@pytest.mark.parametrize("case", CASES, ids=[f"{t}x{h}x{w}" for t, h, w in CASES])
def test_frames_match_reference(processor, case):
    video = _random_video(*case)
    ours, expected = processor([video]), _expected([video])
    assert torch.equal(ours.grid_thw, expected["video_grid_thw"])
    assert torch.equal(ours.pixel_values, expected["pixel_values_videos"])  # bit-exact


def test_several_videos_and_input_kinds(processor):
    a, b = _random_video(4, 64, 96, 1), _random_video(6, 120, 80, 2)
    frames_as_pil = [Image.fromarray(f) for f in b]
    ours = processor([a, frames_as_pil])
    expected = _expected([a, b])
    assert torch.equal(ours.grid_thw, expected["video_grid_thw"])
    assert torch.equal(ours.pixel_values, expected["pixel_values_videos"])
    assert torch.equal(processor(torch.from_numpy(a)).pixel_values, processor([a]).pixel_values)


def test_per_frame_cap_option(tmp_path: Path):
    (tmp_path / "video_preprocessor_config.json").write_text(json.dumps({**CONFIG, "cap_pixels_per_frame": True}))
    capped = VideoProcessor.from_pretrained(tmp_path)
    video = _random_video(4, 720, 1280, 3)
    ours, expected = capped([video]), _expected([video], cap=True)
    assert torch.equal(ours.grid_thw, expected["video_grid_thw"])
    assert torch.equal(ours.pixel_values, expected["pixel_values_videos"])


def test_sampled_clip_matches_reference(processor, tmp_path: Path):
    clip = sample_video(video_files.encode(tmp_path / "v.mp4", 40), num_frames=6)
    ours, expected = processor(clip), _expected([clip.frames])
    assert torch.equal(ours.pixel_values, expected["pixel_values_videos"])
    assert ours.grid_thw.tolist() == [[3, 4, 4]]  # 48x64 -> 64x64 pixels = 4x4 patches of 16


def test_defaults_and_refusals(tmp_path: Path):
    assert VideoProcessor.from_pretrained(tmp_path).config == VideoProcessor().config
    assert (VideoProcessor().config.min_pixels, VideoProcessor().config.max_pixels) == (4096, 25165824)
    (tmp_path / "video_preprocessor_config.json").write_text(json.dumps({**CONFIG, "resample": 1}))
    with pytest.raises(ValueError, match="resample=1"):
        VideoProcessor.from_pretrained(tmp_path)
    with pytest.raises(ValueError, match="uint8"):
        VideoProcessor()([np.zeros((2, 32, 32, 3), dtype=np.float32)])
