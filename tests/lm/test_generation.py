"""Greedy generation against transformers' `generate`, batching, and the sampler."""

import pytest
import torch

import mm
from lm import SamplingParams, generate, stream_generate


@pytest.mark.parametrize("kind", ["moe_vl", "dense_vl", "moe_text", "dense_text"])
def test_greedy_generation_equals_transformers(checkpoints, kind):
    hf, path = checkpoints(kind)
    model = mm.load_model(path)
    ids = torch.randint(3, 500, (1, 21), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        ref = hf.generate(ids, max_new_tokens=24, do_sample=False, eos_token_id=None)[0, 21:].tolist()
    assert model.generate(ids, max_new_tokens=24, eos_token_ids=()) == [ref]


def test_batch_of_different_lengths_equals_each_alone(checkpoints):
    hf, path = checkpoints("moe_vl")
    model = mm.load_model(path)
    g = torch.Generator().manual_seed(6)
    prompts = [torch.randint(3, 500, (n,), generator=g) for n in (9, 30, 17)]
    width = max(len(p) for p in prompts)
    ids = torch.zeros(3, width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, p in enumerate(prompts):
        ids[row, width - len(p) :], mask[row, width - len(p) :] = p, 1
    lengths = [12, 20, 5]  # rows finish at different steps and leave the batch
    params = [SamplingParams(max_new_tokens=n) for n in lengths]
    batched = generate(model.lm, ids, params, attention_mask=mask)
    for p, n, out in zip(prompts, lengths, batched):
        with torch.no_grad():
            ref = hf.generate(p[None], max_new_tokens=n, do_sample=False, eos_token_id=None)[0, len(p) :]
        assert out == ref.tolist()


def test_stop_tokens_and_finish_reasons(checkpoints):
    _, path = checkpoints("dense_text")
    lm = mm.load_model(path).lm
    ids = torch.randint(3, 500, (1, 10), generator=torch.Generator().manual_seed(7))
    free = generate(lm, ids, SamplingParams(max_new_tokens=12))[0]
    stop_at = free[4]
    events = list(stream_generate(lm, ids, SamplingParams(max_new_tokens=12, stop_token_ids=(stop_at,))))
    first = free.index(stop_at)
    assert [e.token for e in events] == free[: first + 1]
    assert events[-1].finish_reason == "stop" and all(e.finish_reason is None for e in events[:-1])
    events = list(stream_generate(lm, ids, SamplingParams(max_new_tokens=3)))
    assert [e.finish_reason for e in events] == [None, None, "length"]
    eos = list(stream_generate(lm, ids, SamplingParams(max_new_tokens=12), eos_token_ids=(stop_at,)))
    assert eos[-1].token == stop_at and eos[-1].finish_reason == "stop"


def test_seeded_sampling_is_reproducible_and_seeds_differ(checkpoints):
    _, path = checkpoints("moe_text")
    lm = mm.load_model(path).lm
    ids = torch.randint(3, 500, (1, 10), generator=torch.Generator().manual_seed(8))

    def run(seed):
        p = SamplingParams(max_new_tokens=16, temperature=1.5, top_p=0.95, top_k=50, min_p=0.01, seed=seed)
        return generate(lm, ids, p)[0]

    assert run(1) == run(1)
    assert run(1) != run(2)


def test_the_same_prompts_give_the_same_logits_bit_for_bit(checkpoints):
    """Prefill (its experts: expert_mlp) and decode steps (moe_decode) add the experts' outputs in one
    order whichever thread computed them: two runs give the same bits, so greedy answers repeat."""
    _, path = checkpoints("moe_text")
    lm = mm.load_model(path).lm
    ids = torch.randint(3, 500, (2, 30), generator=torch.Generator().manual_seed(8))

    def run():
        cache = lm.make_cache(2, 30)
        with torch.no_grad():
            out = [lm(ids[:, :24], cache=cache)]
            out += [lm(ids[:, i : i + 1], cache=cache) for i in range(24, 30)]
        return torch.cat(out, 1)

    first = run()
    assert all(torch.equal(run(), first) for _ in range(5))
