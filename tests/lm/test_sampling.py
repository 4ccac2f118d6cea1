"""The sampler's filters and penalties, on hand-made logits."""

import pytest
import torch

from lm import Sampler, SamplingParams
from lm import sampling
from lm.sampling import DRAW_BLOCK, _candidates, _penalise, argmax, draw, largest


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


@pytest.mark.parametrize("cpu_kernels", ["0", "1"])  # torch.topk, the kernel's largest_k
def test_largest_equals_torch_topk(monkeypatch, cpu_kernels):
    """`largest` gives torch.topk's values, and the indices of a stable descending sort (k from 0
    to all, a vocabulary of 248,320, ascending values: every value passes the running threshold):
    equal values by index (torch.topk orders them as it may), NaN first."""
    monkeypatch.setenv("QWEN35_CPU_KERNELS", cpu_kernels)
    g = torch.Generator().manual_seed(3)
    for n, ks in [(248_320, [1, 20, 1024]), (1000, [0, 7, 999, 1000]), (13, [13]), (4099, [40])]:
        scores = torch.randn(n, generator=g) * 3
        order = torch.sort(scores, descending=True, stable=True).indices
        for k in ks:
            values, index = largest(scores, k)
            assert torch.equal(values, torch.topk(scores, k).values), (n, k)
            if cpu_kernels == "1":
                assert torch.equal(index, order[:k]), (n, k)
            assert torch.equal(scores[index], values)
    ascending = torch.arange(5000, dtype=torch.float32)
    assert torch.equal(largest(ascending, 30)[1], torch.topk(ascending, 30).indices)
    if cpu_kernels == "1":
        ties = torch.tensor([1.0, float("nan"), 3.0, 3.0, float("-inf"), float("nan"), 2.0, 3.0])
        values, index = largest(ties, 6)
        assert index.tolist() == [1, 5, 2, 3, 7, 6] and values[2:].tolist() == [3.0, 3.0, 3.0, 2.0]
        banned = torch.full((100,), float("-inf"))
        banned[50] = 0.0
        assert largest(banned, 3)[1].tolist() == [50, 0, 1]


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


def _chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs / probs.sum() * counts.sum()
    seen = expected > 0
    assert not counts[~seen].any(), "an entry of zero weight was drawn"
    return float(((counts[seen] - expected[seen]) ** 2 / expected[seen]).sum())


def test_draw_follows_the_weights_across_blocks():
    """Weights spread over three blocks of DRAW_BLOCK and a partial one (zeros between them), not
    normalised: 40,000 draws of a fixed seed against their law. 27.88 is the chi-square quantile at
    0.999 for 9 degrees of freedom; torch.multinomial passes the same check."""
    probs = torch.zeros(3 * DRAW_BLOCK + 37)
    hot = [0, 5, DRAW_BLOCK - 1, DRAW_BLOCK, 2 * DRAW_BLOCK + 500, 3 * DRAW_BLOCK - 1, 3 * DRAW_BLOCK,
           3 * DRAW_BLOCK + 36, 17, 2 * DRAW_BLOCK]
    probs[hot] = torch.tensor([3.0, 0.5, 1.0, 2.0, 0.25, 1.5, 0.75, 2.5, 0.05, 1.0])
    g = torch.Generator().manual_seed(0)
    counts = torch.bincount(torch.tensor([draw(probs, g) for _ in range(40_000)]), minlength=probs.numel())
    assert _chi_square(counts.float(), probs) < 27.88
    reference = torch.bincount(torch.multinomial(probs, 40_000, replacement=True, generator=torch.Generator().manual_seed(0)),
                               minlength=probs.numel())  # fmt: skip
    assert _chi_square(reference.float(), probs) < 27.88


def test_draw_is_reproducible_and_takes_any_float_dtype():
    probs = torch.softmax(torch.randn(5000, generator=torch.Generator().manual_seed(1)), -1)
    a = [draw(probs, torch.Generator().manual_seed(7)) for _ in range(3)]
    g = torch.Generator().manual_seed(7)
    assert [draw(probs, g) for _ in range(1)] == a[:1] and len(set(a)) == 1
    assert draw(probs.double(), torch.Generator().manual_seed(7)) == a[0]
    assert draw(probs.bfloat16(), torch.Generator().manual_seed(7)) in range(5000)


def test_draw_at_the_top_of_the_uniform_range_takes_the_last_weighted_entry(monkeypatch):
    """A uniform number that rounds up to the total (or a block's float64 sum above its running sum)
    draws the last entry with weight, never a zero one or one past the end."""
    monkeypatch.setattr(sampling.torch, "rand", lambda *a, **k: torch.tensor(1.0, dtype=torch.float64))
    probs = torch.zeros(2 * DRAW_BLOCK + 10)
    probs[[3, DRAW_BLOCK + 7]] = torch.tensor([0.3, 0.7])
    assert draw(probs) == DRAW_BLOCK + 7
    assert draw(torch.tensor([0.5, 0.5, 0.0])) == 1


@pytest.mark.parametrize("probs", [[0.5, float("nan")], [0.5, -0.1], [0.0, 0.0], [], [1.0, float("inf")]])
def test_draw_refuses_weights_multinomial_refuses(probs):
    with pytest.raises(ValueError, match="finite and non-negative with a positive sum"):
        draw(torch.tensor(probs))


@pytest.mark.parametrize(
    "kwargs", [dict(max_new_tokens=0), dict(temperature=-1), dict(top_p=0), dict(top_k=-1), dict(min_p=2)]
)
def test_invalid_params_are_refused(kwargs):
    with pytest.raises(ValueError, match="invalid SamplingParams"):
        SamplingParams(**kwargs)


def test_stop_accepts_a_single_string():
    assert SamplingParams(stop="###").stop == ("###",)
