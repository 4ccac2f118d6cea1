"""smart_resize (image and video rule) against transformers' functions, rounding included."""

import random

import pytest
from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize as ref_image
from transformers.models.qwen3_vl.video_processing_qwen3_vl import smart_resize as ref_video

from preprocess import smart_resize
from preprocess.smart_resize import smart_resize_video

SIZES = [(1, 1), (10, 300), (31, 33), (48, 64), (224, 224), (240, 320), (500, 333), (1080, 1920),
         (32, 6000), (30, 5990), (5000, 4000), (16000, 16000), (4096, 4097), (7, 1393)]


def _random_sizes(count: int, seed: int) -> list[tuple[int, int]]:
    rng = random.Random(seed)
    sizes = []
    while len(sizes) < count:
        h, w = rng.randint(1, 9000), rng.randint(1, 9000)
        if max(h, w) / min(h, w) <= 200:
            sizes.append((h, w))
    return sizes


@pytest.mark.parametrize("budget", [(65536, 16777216), (56 * 56, 28 * 28 * 1280), (4096, 25165824)])
def test_image_rule_equals_transformers(budget):
    for h, w in SIZES + _random_sizes(300, seed=budget[0]):
        ours = smart_resize(h, w, 32, *budget)
        assert ours == ref_image(h, w, 32, *budget), (h, w)
        assert ours[0] % 32 == 0 and ours[1] % 32 == 0 and min(ours) >= 32


def test_image_rule_keeps_pixels_in_budget():
    for h, w in _random_sizes(300, seed=1):
        rh, rw = smart_resize(h, w)
        if min(rh, rw) > 32:  # a side clamped to 32 may break the budget, as in the reference
            assert 65536 <= rh * rw <= 16777216, (h, w)


@pytest.mark.parametrize("frames", [2, 3, 4, 17, 64, 768])
def test_video_rule_equals_transformers(frames):
    for h, w in SIZES + _random_sizes(100, seed=frames):
        ours = smart_resize_video(frames, h, w, temporal_factor=2, factor=32, min_pixels=4096, max_pixels=25165824)
        assert ours == ref_video(frames, h, w, temporal_factor=2, factor=32, min_pixels=4096,
                                 max_pixels=25165824), (frames, h, w)


def test_errors_name_the_problem():
    with pytest.raises(ValueError, match=r"aspect ratio 201.0 of a 2010x10 \(width x height\) image"):
        smart_resize(10, 2010)  # height 10, width 2010
    with pytest.raises(ValueError, match="positive"):
        smart_resize(0, 10)
    with pytest.raises(ValueError, match="at least 2 frames"):
        smart_resize_video(1, 64, 64)
    assert smart_resize(10, 2000) == ref_image(10, 2000, 32, 65536, 16777216)  # exactly 200:1 is allowed
