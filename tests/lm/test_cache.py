"""Cache consistency: prefill + decode and chunked prefill equal one full forward pass."""

import pytest
import torch

import mm
from lm import CacheOverflowError
from tests.conftest import rel_err

TOL = 1e-4


@pytest.mark.parametrize("kind", ["moe_vl", "dense_text"])
def test_prefill_then_16_decode_steps_equals_full_forward(checkpoints, kind):
    _, path = checkpoints(kind)
    lm = mm.load_model(path).lm
    ids = torch.randint(3, 500, (2, 40), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        full = lm(ids)
        cache = lm.make_cache(2, 64)
        steps = [lm(ids[:, :24], cache=cache)]
        steps += [lm(ids[:, i : i + 1], cache=cache) for i in range(24, 40)]
    assert cache.length == 40
    assert rel_err(torch.cat(steps, dim=1), full) <= TOL


@pytest.mark.parametrize("kind", ["moe_text", "dense_vl"])
def test_prefill_in_chunks_of_7_equals_one_shot(checkpoints, kind):
    _, path = checkpoints(kind)
    lm = mm.load_model(path).lm
    ids = torch.randint(3, 500, (2, 47), generator=torch.Generator().manual_seed(4))
    mask = torch.ones_like(ids)
    mask[0, :9] = 0  # left padding spans the first chunk and a half
    with torch.no_grad():
        full = lm(ids, attention_mask=mask)
        cache = lm.make_cache(2, 47)
        chunks = [lm(ids[:, s : s + 7], attention_mask=mask[:, s : s + 7], cache=cache) for s in range(0, 47, 7)]
    real = mask.bool()
    assert rel_err(torch.cat(chunks, dim=1)[real], full[real]) <= TOL


def test_cache_state_size_is_fixed_for_linear_layers(checkpoints):
    _, path = checkpoints("moe_text")
    lm = mm.load_model(path).lm
    small, big = lm.make_cache(1, 16), lm.make_cache(1, 1024)
    linear = lm.config.linear_attention_layers
    for i in linear:
        assert small.slots[i].recurrent.shape == big.slots[i].recurrent.shape
        assert small.slots[i].conv.shape == big.slots[i].conv.shape
    assert big.slots[lm.config.full_attention_layers[0]].k.shape[2] == 1024


def test_a_cache_is_freed_without_the_cyclic_collector(checkpoints):
    """A KV slot refers to its cache weakly: a cache (a prefix snapshot's gigabytes) is no
    reference cycle and goes the moment it is dropped, not at some later gc run (issue 43)."""
    import gc
    import weakref

    lm = mm.load_model(checkpoints("moe_text")[1]).lm
    gc.disable()
    try:
        cache = lm.make_cache(1, 64)
        lm(torch.ones(1, 5, dtype=torch.long), cache=cache)
        gone = weakref.ref(cache.slots[lm.config.full_attention_layers[0]].k)
        del cache
        assert gone() is None
    finally:
        gc.enable()


def test_prompt_longer_than_max_len_is_refused(checkpoints):
    _, path = checkpoints("dense_text")
    lm = mm.load_model(path).lm
    cache = lm.make_cache(1, 8)
    with pytest.raises(CacheOverflowError, match="max_len=8"):
        lm(torch.ones(1, 9, dtype=torch.long), cache=cache)


def test_key_mask_is_built_only_once_a_row_has_padding(checkpoints):
    """attention_mask_for skips the key mask while no written position is padding (cache.padded),
    and builds it from the first chunk with padding on, also for the decode steps after it."""
    from lm.attention import attention_mask_for

    _, path = checkpoints("moe_text")
    lm = mm.load_model(path).lm
    cache = lm.make_cache(2, 16)
    cache.begin(torch.ones(2, 4, dtype=torch.long), 4)
    cache.advance(4)
    cache.begin(None, 1)
    assert not cache.padded and attention_mask_for(cache, 1) is None
    cache.advance(1)
    cache.begin(torch.tensor([[1, 1], [0, 1]]), 2)  # row 1's first token here is padding
    assert cache.padded
    cache.advance(2)
    cache.begin(None, 1)
    mask = attention_mask_for(cache, 1)
    assert mask is not None and mask[:, 0, 0].tolist() == [[True] * 8, [True] * 5 + [False, True, True]]


def test_begin_token_marks_the_same_key_mask_as_begin(checkpoints):
    """begin_token (the CPU decode plan's steps) writes the key mask through a numpy view: the same
    column begin(None, 1) writes, into the mask `keep` puts in place too; a full cache refuses it."""
    _, path = checkpoints("moe_text")
    lm = mm.load_model(path).lm
    caches = [lm.make_cache(3, 6), lm.make_cache(3, 6)]
    for cache in caches:
        cache.begin(torch.tensor([[1, 1, 1], [0, 1, 1], [0, 0, 1]]), 3)
        cache.advance(3)
    for step in range(3):
        if step == 1:
            for cache in caches:
                cache.keep(torch.tensor([2, 0]))
        caches[0].begin(None, 1)
        caches[1].begin_token()
        for cache in caches:
            cache.advance(1)
        assert torch.equal(caches[0].key_mask, caches[1].key_mask)
    assert caches[1].key_mask.tolist() == [[False, False, True, True, True, True], [True] * 6]
    with pytest.raises(CacheOverflowError, match="max_len=6"):
        caches[1].begin_token()
