"""The multimodal model against transformers: mRoPE positions, fused forward, generation with images."""

import pytest
import torch

import mm
from mm.fusion import PlaceholderMismatchError
from tests.conftest import rel_err

IMG, VID, START, END = 500, 501, 502, 503  # token ids of the tiny test configs
PATCH = 3 * 2 * 16 * 16
TOL = 1e-4


def _text(n, g):
    return torch.randint(3, 400, (n,), generator=g).tolist()


def _image(grid):
    t, h, w = grid
    return [START] + [IMG] * (t * h * w // 4) + [END]


def _video(grid, g):
    t, h, w = grid
    ids = []
    for _ in range(t):  # "<x.x seconds>" is a few text tokens before each 2-frame group
        ids += _text(3, g) + [START] + [VID] * (h * w // 4) + [END]
    return ids


def _batch(rows, pad=0):
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, width - len(r) :], mask[i, width - len(r) :] = torch.tensor(r), 1
    return ids, mask


def _mm_inputs(seed=0):
    """Two rows, left-padded: row 0 has two images; row 1 has a video and text. Random pixels."""
    g = torch.Generator().manual_seed(seed)
    img_a, img_b, vid = (1, 4, 6), (1, 8, 4), (3, 4, 4)
    row0 = _text(5, g) + _image(img_a) + _text(4, g) + _image(img_b) + _text(6, g)
    row1 = _text(3, g) + _video(vid, g) + _text(7, g)
    ids, mask = _batch([row0, row1])
    images = torch.tensor([img_a, img_b])
    videos = torch.tensor([vid])
    pixels = torch.randn(int(images.prod(-1).sum()), PATCH, generator=g)
    video_pixels = torch.randn(int(videos.prod(-1).sum()), PATCH, generator=g)
    return dict(input_ids=ids, attention_mask=mask, pixel_values=pixels, image_grid_thw=images,
                pixel_values_videos=video_pixels, video_grid_thw=videos)


def _types(ids):
    return ((ids == IMG) * 1 + (ids == VID) * 2).int()


@pytest.mark.parametrize("kind", ["moe_vl", "dense_vl"])
def test_mrope_positions_equal_get_rope_index(checkpoints, kind):
    hf, path = checkpoints(kind)
    model = mm.load_model(path)
    x = _mm_inputs()
    ours, deltas = mm.mrope_positions(x["input_ids"], x["image_grid_thw"], x["video_grid_thw"], x["attention_mask"],
                                      config=model.config)
    ref, ref_deltas = hf.model.get_rope_index(
        x["input_ids"], mm_token_type_ids=_types(x["input_ids"]), image_grid_thw=x["image_grid_thw"],
        video_grid_thw=x["video_grid_thw"].clone(), attention_mask=x["attention_mask"],
    )
    assert torch.equal(ours, ref) and torch.equal(deltas, ref_deltas)


@pytest.mark.parametrize("kind", ["moe_vl", "dense_vl"])
def test_forward_with_two_images_a_video_and_left_padding(checkpoints, kind):
    hf, path = checkpoints(kind)
    model = mm.load_model(path)
    x = _mm_inputs(1)
    with torch.no_grad():
        ref = hf(**{**x, "video_grid_thw": x["video_grid_thw"].clone()}, mm_token_type_ids=_types(x["input_ids"])).logits
    out = model(**x)
    real = x["attention_mask"].bool()
    assert rel_err(out[real], ref[real]) <= TOL


def test_greedy_generation_with_an_image_equals_transformers(checkpoints):
    hf, path = checkpoints("moe_vl")
    model = mm.load_model(path)
    g = torch.Generator().manual_seed(2)
    grid = torch.tensor([[1, 8, 8]])
    ids = torch.tensor([_text(4, g) + _image((1, 8, 8)) + _text(5, g)])
    pixels = torch.randn(64, PATCH, generator=g)
    with torch.no_grad():
        ref = hf.generate(input_ids=ids, pixel_values=pixels, image_grid_thw=grid, mm_token_type_ids=_types(ids),
                          max_new_tokens=20, do_sample=False, eos_token_id=None)[0, ids.shape[1] :]
    ours = model.generate(ids, max_new_tokens=20, pixel_values=pixels, image_grid_thw=grid, eos_token_ids=())
    assert ours == [ref.tolist()]


def test_batched_generation_with_video_and_padding_equals_rows_alone(checkpoints):
    _, path = checkpoints("moe_vl")
    model = mm.load_model(path)
    x = _mm_inputs(3)
    both = model.generate(x["input_ids"], max_new_tokens=8, eos_token_ids=(), attention_mask=x["attention_mask"],
                          pixel_values=x["pixel_values"], image_grid_thw=x["image_grid_thw"],
                          pixel_values_videos=x["pixel_values_videos"], video_grid_thw=x["video_grid_thw"])
    real0, real1 = (x["attention_mask"][i].bool() for i in range(2))
    alone0 = model.generate(x["input_ids"][0:1, real0], max_new_tokens=8, eos_token_ids=(),
                            pixel_values=x["pixel_values"], image_grid_thw=x["image_grid_thw"])
    alone1 = model.generate(x["input_ids"][1:2, real1], max_new_tokens=8, eos_token_ids=(),
                            pixel_values_videos=x["pixel_values_videos"], video_grid_thw=x["video_grid_thw"])
    assert both == alone0 + alone1


def test_placeholder_count_mismatch_is_a_clear_error(checkpoints):
    _, path = checkpoints("moe_vl")
    model = mm.load_model(path)
    g = torch.Generator().manual_seed(4)
    ids = torch.tensor([_text(3, g) + _image((1, 4, 4))[:-2] + [END]])  # one pad short
    with pytest.raises(PlaceholderMismatchError, match="3 image placeholder tokens.*4 features"):
        model(ids, pixel_values=torch.randn(16, PATCH), image_grid_thw=torch.tensor([[1, 4, 4]]))


def test_text_only_checkpoint_refuses_images(checkpoints):
    _, path = checkpoints("moe_text")
    model = mm.load_model(path)
    ids = torch.tensor([[1, START, IMG, IMG, IMG, IMG, END]])
    with pytest.raises(ValueError, match="no vision tower"):
        model(ids, pixel_values=torch.randn(16, PATCH), image_grid_thw=torch.tensor([[1, 4, 4]]))
