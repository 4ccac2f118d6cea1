"""Logits of our LM against transformers, float32, tiny random checkpoints of every kind."""

import pytest
import torch

import mm
from tests import tiny
from tests.conftest import rel_err

TOL = 1e-4


@pytest.mark.parametrize("kind", tiny.KINDS)
def test_logits_match_transformers(checkpoints, kind):
    hf, path = checkpoints(kind)
    model = mm.load_model(path)
    ids = torch.randint(3, 500, (2, 45), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(input_ids=ids).logits
    assert rel_err(model(ids), ref) <= TOL


@pytest.mark.parametrize("kind", ["moe_vl", "dense_text"])
def test_left_padded_batch(checkpoints, kind):
    """Each padded row equals that sequence alone, and equals transformers given the same positions."""
    hf, path = checkpoints(kind)
    model = mm.load_model(path)
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(3, 500, (3, 40), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :7] = 0
    mask[2, :25] = 0
    ids[mask == 0] = 0
    out = model(ids, attention_mask=mask)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        ref = hf(input_ids=ids, attention_mask=mask, position_ids=positions).logits
    real = mask.bool()
    assert rel_err(out[real], ref[real]) <= TOL
    for row in range(3):
        alone = model(ids[row : row + 1, real[row]])
        assert rel_err(out[row, real[row]], alone[0]) <= TOL


def test_qwen3_5_moe_real_layer_pattern_and_interval(checkpoints):
    """`full_attention_interval` without `layer_types` gives the same layers as the explicit list."""
    from lm import TextConfig

    explicit = TextConfig.from_hf(tiny.text_config(True))
    implicit_cfg = tiny.text_config(True)
    del implicit_cfg["layer_types"]
    implicit_cfg["full_attention_interval"] = 4
    assert TextConfig.from_hf(implicit_cfg).layer_types == explicit.layer_types
