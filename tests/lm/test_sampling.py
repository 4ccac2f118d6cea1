"""The sampler's filters and penalties, on hand-made logits."""

import pytest
import torch

from lm import Sampler, SamplingParams
from lm.sampling import _candidates, _penalise, argmax


def test_greedy_picks_argmax_per_row():
    logits = torch.tensor([[0.0, 3.0, 1.0], [5.0, 0.0, 1.0]])
    sampler = Sampler([SamplingParams(), SamplingParams()], [[], []])
    assert sampler(logits, [0, 1], [[], []]) == [1, 0]


@pytest.mark.parametrize("cpu_kernels", ["0", "1"])  # numpy's argmax, the kernel's
def test_argmax_follows_torch_on_ties_nan_and_infinities(monkeypatch, cpu_kernels):
    monkeypatch.setenv("QWEN35_CPU_KERNELS", cpu_kernels)
    cases = [[0.0, 2.0, 2.0, 1.0], [float("-inf")] * 3, [1.0, float("nan"), 3.0, float("nan")],
             [float("inf"), 1.0, float("inf")], torch.randn(248320).tolist()]
    for values in cases:
        scores = torch.tensor(values)
        assert argmax(scores) == int(scores.argmax()), values[:4]
        strided = torch.stack([scores, scores], dim=1)[:, 0]  # not contiguous
        assert argmax(strided) == int(scores.argmax())


@pytest.mark.parametrize("cpu_kernels", ["0", "1"])  # per row, or the kernel's one call for all rows
def test_plain_greedy_batches_pick_each_rows_argmax(monkeypatch, cpu_kernels):
    """A sampler whose rows are all greedy without penalties picks every row's argmax (with the
    kernels, in one call); a penalised row sends the batch through the per-row path."""
    monkeypatch.setenv("QWEN35_CPU_KERNELS", cpu_kernels)
    logits = torch.randn(4, 1000, generator=torch.Generator().manual_seed(0))
    logits[1, [7, 300]] = 9.0  # a tie: the first
    logits[2, 500] = float("nan")
    logits[3] = float("-inf")
    expected = [int(row.argmax()) for row in logits]
    sampler = Sampler([SamplingParams()] * 4, [[]] * 4)
    assert sampler.plain_greedy and sampler(logits, [0, 1, 2, 3], [[]] * 4) == expected
    penalised = Sampler([SamplingParams(), SamplingParams(repetition_penalty=2.0)], [[], [expected[1]]])
    assert not penalised.plain_greedy
    assert penalised(logits[:2], [0, 1], [[], []]) == [expected[0], 300]  # 7 halved


def test_top_k_top_p_min_p_filters():
    scores = torch.log(torch.tensor([0.25, 0.5, 0.15, 0.07, 0.03]))
    ids, probs = _candidates(scores, SamplingParams(temperature=1, top_k=2))
    assert ids.tolist() == [1, 0] and torch.allclose(probs, torch.tensor([2 / 3, 1 / 3]))
    ids, probs = _candidates(scores, SamplingParams(temperature=1, top_p=0.7))  # 0.5 + 0.25 reaches 0.7
    assert ids.tolist() == [1, 0] and torch.allclose(probs, torch.tensor([2 / 3, 1 / 3]))
    ids, probs = _candidates(scores, SamplingParams(temperature=1, min_p=0.2))  # keep p >= 0.1
    assert ids.tolist() == [1, 0, 2] and torch.isclose(probs.sum(), torch.tensor(1.0))
    ids, probs = _candidates(scores, SamplingParams(temperature=1))
    assert ids is None and torch.allclose(probs, torch.tensor([0.25, 0.5, 0.15, 0.07, 0.03]))  # every token


def test_top_p_and_min_p_over_a_large_vocabulary_equal_the_full_sort():
    """The cut is looked for among the likeliest tokens first; where it lies beyond them, the whole
    vocabulary is sorted: both keep the tokens, with the probabilities, that sorting everything keeps."""
    g = torch.Generator().manual_seed(0)
    cases = [(4.0, SamplingParams(temperature=1, top_p=0.9)), (0.1, SamplingParams(temperature=1, top_p=0.95)),
             (3.0, SamplingParams(temperature=1, min_p=0.05)), (0.1, SamplingParams(temperature=1, min_p=0.5))]
    for scale, params in cases:
        scores = torch.randn(5000, generator=g) * scale  # peaked (a short prefix) or flat (beyond the first 1024)
        ids, probs = _candidates(scores, params)
        ordered, index = torch.sort(scores, descending=True)
        full = torch.softmax(ordered, dim=-1)
        keep = (full.cumsum(-1) - full < params.top_p) & (full >= params.min_p * full[0])
        assert set(ids.tolist()) == set(index[keep].tolist())
        assert torch.allclose(probs, full[keep] / full[keep].sum(), atol=1e-6)


def test_repetition_and_presence_penalties():
    scores = torch.tensor([2.0, -2.0, 1.0, 0.5])
    rep = _penalise(scores, SamplingParams(repetition_penalty=2.0), prompt=[0], output=[1])
    assert rep.tolist() == [1.0, -4.0, 1.0, 0.5]
    pres = _penalise(scores, SamplingParams(presence_penalty=1.5), prompt=[0], output=[2, 2])
    assert pres.tolist() == [2.0, -2.0, -0.5, 0.5]  # only generated tokens, once each
    freq = _penalise(scores, SamplingParams(frequency_penalty=0.5), prompt=[0], output=[2, 2, 3])
    assert freq.tolist() == [2.0, -2.0, 0.0, 0.0]  # times how often each was generated


def test_token_rule_allows_and_bans():
    from lm.sampling import TokenRule

    logits = torch.tensor([1.0, 3.0, 2.0, 0.0])
    assert int(TokenRule(allow=(0, 2)).apply(logits).argmax()) == 2
    assert int(TokenRule(ban=(1,)).apply(logits).argmax()) == 2
    assert TokenRule(allow=(3,)).apply(logits).isinf().sum() == 3


@pytest.mark.parametrize("cpu_kernels", ["0", "1"])  # the reference (unpack, masked_fill), the kernel's pass
def test_token_rule_bits_keep_exactly_the_set_bits(monkeypatch, cpu_kernels):
    """A rule's packed bitmask (bit t % 32 of word t // 32) keeps the logits of exactly its set bits
    and puts -inf elsewhere, as the same bool mask does, over a vocabulary that is no multiple of 32,
    with words all set, all clear and mixed; pack_tokens / unpack_tokens are each other's inverse."""
    from lm.sampling import TokenRule, pack_tokens, unpack_tokens

    monkeypatch.setenv("QWEN35_CPU_KERNELS", cpu_kernels)
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(1000, generator=generator)
    mask = torch.rand(1000, generator=generator) < 0.5
    mask[:64], mask[64:128], mask[992:] = True, False, True  # whole words set and clear, a cut last word
    bits = pack_tokens(mask)
    assert bits.dtype == torch.int32 and bits.shape == (32,) and bool((bits[:2] == -1).all()) and bits[2:4].eq(0).all()
    assert torch.equal(unpack_tokens(bits, 1000), mask)
    expected = logits.masked_fill(~mask, float("-inf"))
    assert torch.equal(TokenRule(bits=bits).apply(logits), expected)
    assert torch.equal(TokenRule(mask=mask).apply(logits), expected)
    assert torch.equal(TokenRule(bits=bits, ban=(0,)).apply(logits)[1:], expected[1:])
    assert torch.equal(logits, torch.randn(1000, generator=torch.Generator().manual_seed(0)))  # not in place


def test_sampling_follows_the_distribution():
    logits = torch.log(torch.tensor([[0.6, 0.3, 0.1]]))
    sampler = Sampler([SamplingParams(temperature=1.0, seed=0)], [[]])
    counts = torch.zeros(3)
    for _ in range(3000):
        counts[sampler(logits, [0], [[]])[0]] += 1
    assert torch.allclose(counts / 3000, torch.tensor([0.6, 0.3, 0.1]), atol=0.03)


@pytest.mark.parametrize(
    "kwargs", [dict(max_new_tokens=0), dict(temperature=-1), dict(top_p=0), dict(top_k=-1), dict(min_p=2)]
)
def test_invalid_params_are_refused(kwargs):
    with pytest.raises(ValueError, match="invalid SamplingParams"):
        SamplingParams(**kwargs)


def test_stop_accepts_a_single_string():
    assert SamplingParams(stop="###").stop == ("###",)
