"""Parity of the vision tower with transformers' Qwen3_5MoeVisionModel / Qwen3_5VisionModel."""

from functools import lru_cache

import pytest
import torch
import torch.nn.functional as F

from tests.vision._reference import hf_vision_config, ours_from, patches, perturbed_reference, rel_err
from vision.attention import Segments
from vision.pos_embed import resampled_pos_embed

GRIDS = {
    "one_image": [[1, 8, 12]],
    "images_of_different_sizes": [[1, 4, 4], [1, 10, 6], [1, 2, 2], [1, 6, 10]],
    "video": [[4, 8, 12]],
    "mix": [[1, 4, 6], [3, 6, 4], [1, 6, 4], [1, 4, 6], [2, 2, 8]],
}


@lru_cache(maxsize=None)
def towers(moe: bool, num_position_embeddings: int, fast: bool = True):
    ref = perturbed_reference(hf_vision_config(moe=moe, num_position_embeddings=num_position_embeddings))
    return ours_from(ref, fast), ref


@pytest.mark.parametrize("grid", GRIDS.values(), ids=GRIDS.keys())
@pytest.mark.parametrize("fast", [True, False], ids=["fast", "plain"])
@pytest.mark.parametrize("num_position_embeddings", [2304, 256])
@pytest.mark.parametrize("moe", [True, False], ids=["moe", "dense"])
def test_matches_reference(moe, num_position_embeddings, fast, grid):
    ours, ref = towers(moe, num_position_embeddings, fast)
    x, grid_thw = patches(grid)
    with torch.inference_mode():
        got = ours(x, grid_thw)
        want = ref(x, grid_thw).pooler_output
    assert got.shape == want.shape == (x.shape[0] // 4, 48)
    assert rel_err(got, want) < 1e-5


@pytest.mark.parametrize("fast", [True, False], ids=["fast", "plain"])
def test_bfloat16_close_to_reference(fast):
    ours, ref = towers(True, 2304, fast)
    ours, ref = ours.to(torch.bfloat16), ref.to(torch.bfloat16)
    try:
        x, grid_thw = patches(GRIDS["mix"])
        with torch.inference_mode():
            got, want = ours(x, grid_thw), ref(x, grid_thw).pooler_output
        assert got.dtype == torch.bfloat16
        assert rel_err(got.float(), want.float()) < 3e-2
    finally:
        ours.float(), ref.float()


@pytest.mark.parametrize("grid, changed", [
    ([[1, 8, 12], [1, 8, 12]], 1),  # equal-sized images share one batched attention call
    ([[1, 4, 6], [1, 8, 8], [1, 4, 6]], 1),
    ([[3, 6, 8]], 2),  # frame groups of one video
])
def test_attention_never_crosses_segments(grid, changed):
    """Changing one segment's pixels leaves every other segment's outputs bit-identical."""
    ours, _ = towers(True, 2304)
    x, grid_thw = patches(grid)
    seg_lengths = [h * w for t, h, w in grid for _ in range(t)]
    start = sum(seg_lengths[:changed])
    y = x.clone()
    y[start:start + seg_lengths[changed]] += torch.randn(seg_lengths[changed], x.shape[1])
    with torch.inference_mode():
        a, b = ours(x, grid_thw), ours(y, grid_thw)
    lo, hi = start // 4, (start + seg_lengths[changed]) // 4
    assert torch.equal(a[:lo], b[:lo]) and torch.equal(a[hi:], b[hi:])
    assert not torch.equal(a[lo:hi], b[lo:hi])


@pytest.mark.parametrize("limit", [1, 40, 100])
def test_frames_in_slices_equal_the_whole(limit):
    """The fast path over slices of whole frames of at most `slice_patches` patches (one frame when a
    frame is larger) gives the features of one pass over them all, and of transformers."""
    ours, ref = towers(True, 2304)
    x, grid_thw = patches(GRIDS["mix"])  # 10 frames of 4 to 36 patches, 192 in all
    with torch.inference_mode():
        whole = ours(x, grid_thw)
        try:
            ours.slice_patches = limit
            sliced = ours(x, grid_thw)
            parts = [(a, b) for a, b, _ in ours._slices([(1, 4, 6), (1, 4, 6), (1, 8, 8), (1, 2, 2)])]
        finally:
            ours.slice_patches = 16384
        want = ref(x, grid_thw).pooler_output
    assert rel_err(sliced, whole) < 1e-6 and rel_err(sliced, want) < 1e-5
    expected = {1: [(0, 24), (24, 48), (48, 112), (112, 116)], 40: [(0, 24), (24, 48), (48, 112), (112, 116)],
                100: [(0, 48), (48, 116)]}
    assert parts == expected[limit]


def test_fast_path_matches_plain_path():
    fast, _ = towers(True, 256, True)
    plain, _ = towers(True, 256, False)
    x, grid_thw = patches(GRIDS["mix"])
    assert rel_err(fast(x, grid_thw), plain(x, grid_thw)) < 1e-6


@pytest.mark.parametrize("h, w", [(8, 12), (48, 48), (64, 30), (2, 2), (96, 2)])
@pytest.mark.parametrize("side", [48, 16])
def test_pos_embed_is_align_corners_bilinear(h, w, side):
    table = torch.randn(side * side, 8)
    grid = table.T.reshape(1, 8, side, side)
    want = F.interpolate(grid, size=(h, w), mode="bilinear", align_corners=True)[0]  # [C, h, w]
    # raster -> 2x2-merge-block order
    want = want.reshape(8, h // 2, 2, w // 2, 2).permute(1, 3, 2, 4, 0).reshape(h * w, 8)
    torch.testing.assert_close(resampled_pos_embed(table, h, w, merge=2), want, rtol=1e-4, atol=5e-5)


def test_segments_group_equal_neighbours():
    assert Segments.from_lengths([4, 4, 4, 6, 4, 4]).runs == ((0, 3, 4), (12, 1, 6), (18, 2, 4))
    assert Segments.from_lengths([4, 4]).num_tokens == 8


def test_rejects_bad_inputs():
    ours, _ = towers(True, 2304)
    x, grid_thw = patches([[1, 4, 4]])
    with pytest.raises(ValueError, match="pixel_values"):
        ours(x[:-1], grid_thw)
    with pytest.raises(ValueError, match="multiples of 2"):
        ours(torch.zeros(15, x.shape[1]), torch.tensor([[1, 3, 5]]))


@pytest.mark.parametrize("h, w, side", [(8, 12, 48), (64, 30, 48), (2, 2, 16), (96, 2, 16)])
def test_interpolation_taps_equal_transformers(h, w, side):
    from transformers.vision_utils import get_vision_interpolation_indices_and_weights

    from vision.pos_embed import interpolation_taps

    want_idx, want_w = get_vision_interpolation_indices_and_weights(
        torch.tensor([[1, h, w]]), num_grid_per_side=side, mode="bilinear", align_corners=True, spatial_merge_size=2)
    idx, weights = interpolation_taps(h, w, side, merge=2)
    assert torch.equal(idx, want_idx) and torch.equal(weights, want_w)
