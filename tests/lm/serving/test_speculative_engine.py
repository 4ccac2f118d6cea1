"""Speculative decoding in the serving engine (lm/serving/drafts.py): with the MTP layer, continuous
batching, the prefix cache and rows that do not draft give each request's output without it."""

import pytest
import torch

import mm
from lm import SamplingParams, generate
from lm.serving import Engine, drafts
from tests import tiny

SPECS = [(9, 12), (40, 5), (17, 20), (3, 9), (25, 14), (11, 7)]  # (prompt tokens, new tokens)


@pytest.fixture(scope="module")
def mtp_path(checkpoints, tmp_path_factory):
    made = {}

    def make(kind: str):
        if kind not in made:
            hf, _ = checkpoints(kind)
            made[kind] = tiny.add_mtp(tiny.save(hf, tmp_path_factory.mktemp(f"mtp-engine-{kind}")))
        return made[kind]

    return make


def _prompt(seed: int, n: int) -> list[int]:
    return torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _alone(lm, ids: list[int], n: int) -> list[int]:
    return generate(lm, torch.tensor([ids]), SamplingParams(max_new_tokens=n))[0]


def _models(path, k: int):
    plain = mm.load_model(path).lm
    return plain, mm.load_model(path, speculative="mtp", num_speculative_tokens=k).lm


def _forced(monkeypatch, truths: list[list[int]], wrong_last: bool = False) -> list[tuple[int, list[int]]]:
    """Make each drafting row's drafts its true greedy continuation (one of `truths`, found by its
    tokens so far; the MTP layer still runs, so its cache moves as in a real run). With
    `wrong_last`, the last of several drafts is wrong in rows of an even truth. Returns per call
    (the truth index, the drafts) of every row that drafted."""
    real, made = drafts.draft_all, []

    def forced(lm, states, outputs, positions, ks, pick):
        out = real(lm, states, outputs, positions, ks, lambda i, logits: 0)
        for i, k in enumerate(ks):
            if k == 0:
                continue
            which = next(n for n, truth in enumerate(truths) if truth[: len(outputs[i])] == outputs[i])
            out[i] = truths[which][len(outputs[i]) : len(outputs[i]) + k]
            if wrong_last and k > 1 and which % 2 == 0:
                out[i][-1] = (out[i][-1] + 1) % 512
            made.append((which, list(out[i])))
        return out

    monkeypatch.setattr(drafts, "draft_all", forced)
    return made


@pytest.mark.parametrize("kind", ["moe_text", "dense_text"])
@pytest.mark.parametrize("k", [1, 3])
def test_engine_with_mtp_equals_one_at_a_time_without(monkeypatch, mtp_path, kind, k):
    """Six requests through 3 slots, arriving while others decode and prefill (the MTP layer's own,
    random, drafts): each output is its greedy output alone without MTP."""
    monkeypatch.setattr(drafts.Payoff, "EVERY", 10**9)  # no timed step without drafts: counts as below
    plain, lm = _models(mtp_path(kind), k)
    engine = Engine(lm, max_batch=3, step_tokens=16, prefix_cache_bytes=0)
    specs = [(_prompt(i, n), m) for i, (n, m) in enumerate(SPECS)]
    handles = [engine.submit(ids, SamplingParams(max_new_tokens=m)) for ids, m in specs]
    for (ids, m), h in zip(specs, handles):
        assert h.result() == _alone(plain, ids, m) and h.finish_reason == "length"
        stats = h.speculative
        assert stats.steps <= stats.drafted <= k * stats.steps
        if stats.accepted == 0:  # (random weights: the drafts are wrong) a step per token but the first
            # (the prompt's), drafting min(k, tokens left - 1), and a last one without drafts
            assert stats.steps == m - 2 and stats.drafted == sum(min(k, m - n - 1) for n in range(1, m - 1))
    assert engine.counters["drafted"] == sum(h.speculative.drafted for h in handles)
    assert engine.stats()["running"] == 0 and engine.store.lengths.sum() == 0
    engine.close()


def test_eight_rows_at_once_with_right_and_wrong_drafts(monkeypatch, mtp_path):
    """Batch 8 (8 slots, 8 requests together; 3 drafts a row: 32 tokens, verified in calls of at
    most 8 through the decode plan): every output is its greedy output alone."""
    plain, lm = _models(mtp_path("moe_text"), 3)
    specs = [(_prompt(40 + i, 5 + 3 * i), 6 + i) for i in range(8)]
    truths = [_alone(plain, ids, m) for ids, m in specs]
    made = _forced(monkeypatch, truths, wrong_last=True)
    engine = Engine(lm, max_batch=8, prefix_cache_bytes=0)
    handles = [engine.submit(ids, SamplingParams(max_new_tokens=m)) for ids, m in specs]
    assert [h.result() for h in handles] == truths
    assert {which for which, _ in made} == set(range(8))
    engine.close()


@pytest.mark.parametrize("kind", ["moe_text", "dense_text"])
@pytest.mark.parametrize("through_layers", [False, True])
def test_rows_accept_their_own_right_drafts_in_the_slots(monkeypatch, mtp_path, kind, through_layers):
    """Right drafts (the last of 3 wrong for even requests): each row accepts its own, the rejected
    positions leave no trace in its slot, and every output is still its greedy output alone;
    through the decode plan's verify and through the layers row by row (beyond its 8 tokens)."""
    plain, lm = _models(mtp_path(kind), 3)
    specs = [(_prompt(i, n), m) for i, (n, m) in enumerate(SPECS[:4])]
    truths = [_alone(plain, ids, m) for ids, m in specs]
    made = _forced(monkeypatch, truths, wrong_last=True)
    if through_layers:
        monkeypatch.setattr(drafts.decode, "verify_logits", lambda *args: None)
    engine = Engine(lm, max_batch=3, step_tokens=16, prefix_cache_bytes=0)
    handles = [engine.submit(ids, SamplingParams(max_new_tokens=m)) for ids, m in specs]
    assert [h.result() for h in handles] == truths
    for n, h in enumerate(handles):
        mine = [d for which, d in made if which == n]
        assert h.speculative.drafted == sum(len(d) for d in mine)
        assert h.speculative.accepted == sum(len(d) - (len(d) > 1 and n % 2 == 0) for d in mine) > 0
        assert h.speculative.tokens_per_step > 1
    engine.close()


def test_a_stop_inside_accepted_drafts_ends_the_request_there(monkeypatch, mtp_path):
    plain, lm = _models(mtp_path("moe_text"), 3)
    ids = _prompt(4, 10)
    truth = _alone(plain, ids, 20)
    _forced(monkeypatch, [truth])
    first = next(i for i, t in enumerate(truth) if i >= 6 and truth.index(t) == i)
    engine = Engine(lm, prefix_cache_bytes=0)
    h = engine.submit(ids, SamplingParams(max_new_tokens=20, stop_token_ids=(truth[first],)))
    assert h.result() == truth[: first + 1] and h.finish_reason == "stop"
    h = engine.submit(ids, SamplingParams(max_new_tokens=20), stop_when=lambda tokens: len(tokens) == 7)
    assert h.result() == truth[:7] and h.finish_reason == "stop"
    engine.close()


def test_prefix_snapshots_carry_the_mtp_state(monkeypatch, mtp_path):
    """Full and partial prefix-cache hits, and a prompt continuing a finished generation: outputs
    equal cold runs, and each resumed request's MTP layer drafts exactly what it drafts cold (its
    state came with the snapshot: the prompt's positions before the hit included)."""
    monkeypatch.setattr(drafts.Payoff, "EVERY", 10**9)  # the same steps draft in both runs
    plain, lm = _models(mtp_path("moe_text"), 2)
    system = _prompt(5, 37)
    questions = [system + _prompt(10 + i, 6 + i) for i in range(2)]
    follow = questions[0] + _alone(plain, questions[0], 10) + _prompt(20, 5)
    seen: list[list[list[int]]] = []
    real = drafts.draft_all

    def recording(lm, states, outputs, positions, ks, pick):
        out = real(lm, states, outputs, positions, ks, pick)
        seen.append([list(d) for d in out])
        return out

    monkeypatch.setattr(drafts, "draft_all", recording)

    def run(engine, prompt, n):
        start = len(seen)
        h = engine.submit(prompt, SamplingParams(max_new_tokens=n))
        out = h.result()
        return out, h.cached_tokens, seen[start:]

    alone = Engine(lm, prefix_cache_bytes=0)
    cold = [run(alone, q, 10) for q in [*questions, follow]]
    alone.close()
    engine = Engine(lm, step_tokens=8, snapshot_every=16)
    runs = [run(engine, q, 10) for q in [questions[0], questions[0], questions[1], follow]]
    # a full hit; a partial one up to the chunk snapshot at 32; the end-of-generation snapshot
    for (out, cached, made), (ref, _, ref_made), want in zip(runs, [cold[0], *cold], (0, 43, 32, 43 + 9)):
        assert out == ref and made == ref_made and cached == want
    assert all(s.state.drafts is not None for s in engine.prefix.snapshots())
    engine.close()


@pytest.mark.parametrize("sampled", [False, True])
def test_logprobs_with_drafts_equal_those_without(monkeypatch, mtp_path, sampled):
    """Requests with logprobs draft too: each accepted token's (log-probability, top ones) is the
    log-softmax at its own position of the verify (after penalties), as a plain step reports it.
    Greedy with right drafts: tokens and logprobs equal those without MTP. Sampled (temperature 1,
    a repetition penalty): every reported log-probability equals a reference log-softmax of the
    main model's logits after the tokens before it."""
    plain, lm = _models(mtp_path("moe_text"), 2)
    specs = [(_prompt(30 + i, n), m) for i, (n, m) in enumerate([(12, 10), (20, 8), (7, 9)])]
    params = [SamplingParams(max_new_tokens=m, logprobs=3, temperature=1.0 if sampled else 0.0,
                             repetition_penalty=1.3 if sampled else 1.0, seed=i) for i, (_, m) in enumerate(specs)]
    ref = Engine(plain, max_batch=3, prefix_cache_bytes=0)
    want = [ref.submit(ids, p) for (ids, _), p in zip(specs, params)]
    truths = [w.result() for w in want]
    ref.close()
    if not sampled:
        _forced(monkeypatch, truths, wrong_last=True)
    engine = Engine(lm, max_batch=3, prefix_cache_bytes=0)
    handles = [engine.submit(ids, p) for (ids, _), p in zip(specs, params)]
    for (ids, m), p, h, w in zip(specs, params, handles, want):
        tokens = h.result()
        assert len(h.logprobs) == len(tokens) == m and h.speculative.drafted > 0
        if not sampled:
            assert tokens == w.tokens and h.speculative.accepted > 0
            for (lp, top), (ref_lp, ref_top) in zip(h.logprobs, w.logprobs):
                assert lp == pytest.approx(ref_lp, abs=1e-4) and [i for i, _ in top] == [i for i, _ in ref_top]
            continue
        logits = plain(torch.tensor([ids + tokens[:-1]]))[0, len(ids) - 1 :]  # the logits before each token
        for j, (lp, top) in enumerate(h.logprobs):
            seen = torch.tensor(sorted(set(ids) | set(tokens[:j])))
            scores = logits[j].clone()
            scores[seen] = torch.where(scores[seen] > 0, scores[seen] / 1.3, scores[seen] * 1.3)
            ref_logp = torch.log_softmax(scores, -1)
            assert lp == pytest.approx(float(ref_logp[tokens[j]]), abs=1e-4)
            assert [i for i, _ in top] == ref_logp.topk(3).indices.tolist()
    engine.close()


def test_payoff_compares_tokens_a_second_with_and_without_drafts():
    payoff = drafts.Payoff()
    assert [payoff.plain_now() for _ in range(64)].count(True) == 64 // drafts.Payoff.EVERY
    for _ in range(3):
        payoff.record(0.010, None)  # 100 tokens/s a row without drafts
        payoff.record(0.015, 2.0)  # 133 with
    assert payoff.speedup is None  # too few steps without drafts yet
    payoff.record(0.010, None)
    assert payoff.speedup == pytest.approx(4 / 3)


def test_drafts_that_do_not_pay_are_said_once(monkeypatch, mtp_path, capsys):
    from lm.kernels import compute

    monkeypatch.setattr(compute, "_said", set())
    monkeypatch.setattr(drafts.Payoff, "EVERY", 2)
    monkeypatch.setattr(drafts.Payoff, "speedup", property(lambda self: 0.5))
    plain, lm = _models(mtp_path("moe_text"), 1)
    engine = Engine(lm, prefix_cache_bytes=0)
    ids = _prompt(1, 8)
    assert engine.submit(ids, SamplingParams(max_new_tokens=12)).result() == _alone(plain, ids, 12)
    err = capsys.readouterr().err
    assert err.count("speculative decoding runs at 0.50x the speed of decoding without drafts") == 1
    assert engine.stats()["speculative_speedup"] == 0.5
    engine.close()


def test_cancel_and_a_failing_rule_end_one_drafting_row_alone(mtp_path):
    """With drafts: a cancelled request frees its slot for a waiting one; a rule that fails (as a
    grammar admitting no token does) ends its request with the error, shown drafts or not; the
    other rows' outputs are their outputs alone."""
    from lm.sampling import TokenRule

    plain, lm = _models(mtp_path("moe_text"), 2)

    class Failing:  # a rule that can roll back and fails on the 4th token
        def __call__(self, tokens):
            if len(tokens) >= 3:
                raise ValueError("the grammar admits no next token")
            return TokenRule(ban=(7,))

        def rollback_to(self, length):
            pass

    engine = Engine(lm, max_batch=2, prefix_cache_bytes=0)
    long = engine.submit(_prompt(1, 12), SamplingParams(max_new_tokens=400))
    bad = engine.submit(_prompt(2, 8), SamplingParams(max_new_tokens=30), rule=Failing())
    waiting = engine.submit(_prompt(3, 10), SamplingParams(max_new_tokens=10))
    with pytest.raises(ValueError, match="admits no next token"):
        bad.result()
    stream = iter(long)
    head = [next(stream) for _ in range(5)]
    long.cancel()
    assert head + list(stream) == long.tokens  # the rest until the engine drops it
    assert long.finish_reason == "cancelled" and 5 <= len(long.tokens) < 400
    assert waiting.result() == _alone(plain, _prompt(3, 10), 10)
    assert engine.stats()["cancelled"] == 1 and engine.stats()["failed"] == 1
    engine.close()
