"""The serving engine (lm/serving): continuous batching equals one request at a time, the
prefix cache is exact, memory stays bounded."""

import threading
import time

import pytest
import torch

import mm
from lm import SamplingParams, generate
from lm.serving import Engine, Prompt, RequestTooLargeError
from lm.serving.slots import trimmed


@pytest.fixture(scope="module")
def lm_moe(checkpoints):
    return mm.load_model(checkpoints("moe_text")[1]).lm


@pytest.fixture(scope="module")
def lm_dense(checkpoints):
    return mm.load_model(checkpoints("dense_text")[1]).lm


def _prompt(seed: int, n: int) -> list[int]:
    return torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _alone(lm, ids: list[int], n: int) -> list[int]:
    return generate(lm, torch.tensor([ids]), SamplingParams(max_new_tokens=n))[0]


def _wait_steps(engine: Engine, steps: int) -> None:
    target = engine.counters["steps"] + steps
    deadline = time.time() + 60
    while engine.counters["steps"] < target and time.time() < deadline:
        time.sleep(0.001)


@pytest.mark.parametrize("which", ["lm_moe", "lm_dense"])
def test_continuous_batching_equals_one_at_a_time(request, which):
    lm = request.getfixturevalue(which)
    engine = Engine(lm, max_batch=3, step_tokens=16, prefix_cache_bytes=0)  # 3 slots: requests queue and reuse slots
    specs = [(_prompt(i, n), m) for i, (n, m) in enumerate([(9, 12), (40, 5), (17, 20), (3, 9), (25, 14), (11, 7)])]
    handles = []
    for ids, m in specs:  # arriving at different steps, while others decode and prefill
        handles.append(engine.submit(ids, SamplingParams(max_new_tokens=m)))
        _wait_steps(engine, 2)
    outs = [h.result() for h in handles]
    for (ids, m), out, h in zip(specs, outs, handles):
        assert out == _alone(lm, ids, m)
        assert h.finish_reason == "length"
    assert engine.stats()["running"] == 0 and engine.store.lengths.sum() == 0
    engine.close()


def test_prompts_waiting_together_are_prefilled_together(lm_moe):
    engine = Engine(lm_moe, max_batch=4, prefix_cache_bytes=1 << 20)
    specs = [(_prompt(60 + i, n), m) for i, (n, m) in enumerate([(5, 8), (23, 4), (11, 12), (2, 6), (17, 9)])]
    with engine.paused():  # the engine thread waits: all five are queued at its first step
        handles = [engine.submit(ids, SamplingParams(max_new_tokens=m)) for ids, m in specs]
    outs = [h.result() for h in handles]
    assert engine.counters["grouped_prefills"] >= 1
    assert outs == [_alone(lm_moe, ids, m) for ids, m in specs]
    again = engine.submit(specs[1][0], SamplingParams(max_new_tokens=4))  # its end-of-prompt snapshot
    assert again.result() == outs[1] and again.cached_tokens == len(specs[1][0])
    engine.close()


def test_ragged_decode_on_the_reference_path(lm_moe, monkeypatch):
    """The layers' own ragged path (no C++ kernels: e.g. CUDA) gives the same tokens."""
    monkeypatch.setenv("QWEN35_CPU_KERNELS", "0")
    engine = Engine(lm_moe, max_batch=2, step_tokens=8, prefix_cache_bytes=0)
    specs = [(_prompt(40 + i, n), m) for i, (n, m) in enumerate([(7, 9), (19, 6), (4, 11)])]
    handles = [engine.submit(ids, SamplingParams(max_new_tokens=m)) for ids, m in specs]
    outs = [h.result() for h in handles]
    engine.close()
    monkeypatch.setenv("QWEN35_CPU_KERNELS", "auto")
    assert outs == [_alone(lm_moe, ids, m) for ids, m in specs]


def test_cancel_mid_generation_frees_the_slot(lm_moe):
    engine = Engine(lm_moe, max_batch=2, prefix_cache_bytes=0)
    long = engine.submit(_prompt(1, 12), SamplingParams(max_new_tokens=400))
    other = engine.submit(_prompt(2, 8), SamplingParams(max_new_tokens=30))
    waiting = engine.submit(_prompt(3, 10), SamplingParams(max_new_tokens=10))  # no slot until one frees
    first = []
    for token in long:
        first.append(token)
        if len(first) == 5:
            long.cancel()
    assert long.finish_reason == "cancelled" and 5 <= len(long.tokens) < 400
    assert other.result() == _alone(lm_moe, _prompt(2, 8), 30)
    assert waiting.result() == _alone(lm_moe, _prompt(3, 10), 10)
    assert engine.stats()["cancelled"] == 1
    engine.close()


def test_stop_tokens_and_eos(lm_moe):
    ids = _prompt(4, 10)
    free = _alone(lm_moe, ids, 12)
    engine = Engine(lm_moe, eos_token_ids=(free[6],), prefix_cache_bytes=0)
    h = engine.submit(ids, SamplingParams(max_new_tokens=12, stop_token_ids=(free[3],)))
    first = free.index(free[3])
    assert h.result() == free[: first + 1] and h.finish_reason == "stop"
    h = engine.submit(ids, SamplingParams(max_new_tokens=12), stop_when=lambda toks: len(toks) == 2)
    assert h.result() == free[:2] and h.finish_reason == "stop"
    engine.close()


def test_prefix_cache_full_and_partial_hits_equal_cold_runs(lm_moe):
    engine = Engine(lm_moe, step_tokens=8, snapshot_every=16)
    system = _prompt(5, 37)
    questions = [system + _prompt(10 + i, 6 + i) for i in range(3)]
    cold = [_alone(lm_moe, q, 10) for q in questions]
    first = engine.submit(questions[0], SamplingParams(max_new_tokens=10))
    assert first.result() == cold[0] and first.cached_tokens == 0
    again = engine.submit(questions[0], SamplingParams(max_new_tokens=10))  # full hit: no prefill at all
    before = engine.counters["prefill_tokens"]
    assert again.result() == cold[0] and again.cached_tokens == len(questions[0])
    assert engine.counters["prefill_tokens"] == before
    # partial hits on the shared system prompt: the first one up to the chunk snapshot at 32; it then
    # snapshots where it leaves question 0 (37 tokens in), so the next one reuses all 37
    for q, ref, cached in zip(questions[1:], cold[1:], (32, 37)):
        h = engine.submit(q, SamplingParams(max_new_tokens=10))
        assert h.result() == ref and h.cached_tokens == cached
    # the end-of-generation snapshot: a prompt that continues a finished generation
    follow = questions[0] + cold[0] + _prompt(20, 5)
    h = engine.submit(follow, SamplingParams(max_new_tokens=6))
    assert h.result() == _alone(lm_moe, follow, 6) and h.cached_tokens == len(questions[0]) + 9
    stats = engine.prefix.stats()
    assert stats["hits"] == 4 and stats["misses"] == 1 and stats["hit_tokens"] > 0
    engine.close()


def test_snapshot_at_a_named_position(lm_moe):
    engine = Engine(lm_moe, snapshot_every=10_000)
    ids = _prompt(6, 30)
    engine.submit(Prompt(ids, snapshot_at=(21,)), SamplingParams(max_new_tokens=3)).result()
    other = ids[:21] + _prompt(7, 9)
    h = engine.submit(other, SamplingParams(max_new_tokens=8))
    assert h.result() == _alone(lm_moe, other, 8) and h.cached_tokens == 21
    engine.close()


def test_named_snapshots_are_capped_per_prompt(lm_moe):
    """One snapshot per message start made a copy of the state per message (issue 43: 5,000
    messages); a prompt takes at most `named_snapshots`: the first and the last ones."""
    engine = Engine(lm_moe, snapshot_every=10_000, named_snapshots=3)
    ids = _prompt(11, 60)
    engine.submit(Prompt(ids, snapshot_at=tuple(range(5, 60, 5))), SamplingParams(max_new_tokens=1)).result()
    assert sorted(len(s.key) for s in engine.prefix.snapshots()) == [5, 50, 55, 60]
    engine.close()
    with pytest.raises(ValueError, match="named_snapshots must be >= 1"):
        Engine(lm_moe, named_snapshots=0)


def test_a_snapshot_larger_than_the_budget_is_never_copied(lm_moe, monkeypatch):
    from lm.serving import scheduler

    copies = []
    monkeypatch.setattr(scheduler, "trimmed", lambda cache, copy: copies.append(copy) or trimmed(cache, copy=copy))
    engine = Engine(lm_moe, prefix_cache_bytes=1, snapshot_every=10_000)
    ids = _prompt(12, 40)
    assert engine.submit(Prompt(ids, snapshot_at=(10, 20)), SamplingParams(max_new_tokens=3)).result() == _alone(
        lm_moe, ids, 3)  # fmt: skip
    assert True not in copies and len(engine.prefix) == 0
    engine.close()


def test_eviction_under_a_tiny_budget_stays_correct(lm_moe):
    probe = Engine(lm_moe)
    probe.submit(_prompt(8, 20), SamplingParams(max_new_tokens=1)).result()
    one = probe.prefix.stats()["bytes"]  # one snapshot of a 20-token prompt
    probe.close()
    engine = Engine(lm_moe, prefix_cache_bytes=int(2.5 * one), snapshot_every=10_000)
    prompts = [_prompt(30 + i, 20) for i in range(5)]
    for rounds in range(2):
        for ids in prompts:
            assert engine.submit(ids, SamplingParams(max_new_tokens=6)).result() == _alone(lm_moe, ids, 6)
            assert engine.prefix.nbytes <= engine.prefix.max_bytes
    assert engine.prefix.evictions > 0
    engine.close()


def test_request_larger_than_the_memory_is_refused_and_others_go_on(lm_moe):
    engine = Engine(lm_moe, max_len=64)
    ok = engine.submit(_prompt(9, 20), SamplingParams(max_new_tokens=30))
    with pytest.raises(RequestTooLargeError, match="more than one slot of this engine holds"):
        engine.submit(_prompt(10, 50), SamplingParams(max_new_tokens=30))
    assert ok.result() == _alone(lm_moe, _prompt(9, 20), 30)
    engine.close()


def test_a_failing_prompt_fails_alone(lm_moe):
    engine = Engine(lm_moe)

    def broken(start, end):
        raise ValueError("this image cannot be read")

    bad = engine.submit(Prompt(_prompt(11, 10), embed=broken), SamplingParams(max_new_tokens=4))
    good = engine.submit(_prompt(12, 10), SamplingParams(max_new_tokens=4))
    with pytest.raises(ValueError, match="cannot be read"):
        bad.result()
    assert good.result() == _alone(lm_moe, _prompt(12, 10), 4)
    engine.close()


@pytest.mark.slow
def test_stress_64_requests_from_many_threads():
    """On the built-in default model (its real vocabulary and architecture)."""
    from app.default_model import default_model_path

    lm_default = mm.load_model(default_model_path()).lm
    engine = Engine(lm_default, step_tokens=32, prefix_cache_bytes=1 << 20)
    baseline = engine.store.nbytes()
    g = torch.Generator().manual_seed(13)
    specs = [(_prompt(100 + i, int(torch.randint(1, 60, (1,), generator=g))), int(torch.randint(1, 24, (1,), generator=g)))
             for i in range(64)]  # fmt: skip
    results: dict[int, list[int]] = {}
    lock = threading.Lock()

    def client(i):
        time.sleep(0.002 * (i % 16))
        ids, m = specs[i]
        h = engine.submit(ids, SamplingParams(max_new_tokens=m))
        tokens = list(h)
        with lock:
            results[i] = tokens

    threads = [threading.Thread(target=client, args=(i,)) for i in range(64)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert sorted(results) == list(range(64))
    for i, (ids, m) in enumerate(specs):
        assert len(results[i]) == m
    for i in range(0, 64, 8):  # a sample against one-at-a-time generation
        assert results[i] == _alone(lm_default, *specs[i])
    stats = engine.stats()
    assert stats["finished"] == 64 and stats["running"] == stats["waiting"] == stats["prefilling"] == 0
    assert engine.store.lengths.sum() == 0 and engine.prefix.nbytes <= engine.prefix.max_bytes
    assert engine.store.nbytes() <= max(baseline, engine.store.max_bytes())
    engine.close()


def test_engine_decodes_through_python_ints_and_one_argmax(lm_moe, monkeypatch):
    """The engine's decode steps take step_tokens (the CPU plan over ragged rows) after the first
    step on each batch size, and pick the rows in one argmax call when every row is greedy with no
    penalty; a penalised row sends the step through each row's sampler. Both equal each alone."""
    import lm.serving.runner
    from tests.conftest import count_step_tokens

    taken = count_step_tokens(monkeypatch, lm.serving.runner)
    engine = Engine(lm_moe, max_batch=3, prefix_cache_bytes=0)
    specs = [(_prompt(70, 9), SamplingParams(max_new_tokens=8)), (_prompt(71, 14), SamplingParams(max_new_tokens=12)),
             (_prompt(72, 5), SamplingParams(max_new_tokens=5, repetition_penalty=1.3))]
    with engine.paused():  # all three start decoding together
        handles = [engine.submit(ids, params) for ids, params in specs]
    outs = [h.result() for h in handles]
    engine.close()
    taken = list(taken)  # the engine's steps (the reference below decodes through the same core)
    assert outs == [generate(lm_moe, torch.tensor([ids]), params)[0] for ids, params in specs]
    assert len(taken) == 11 and taken.count(False) <= 3  # a first step per batch size (3, 2, 1 rows)
