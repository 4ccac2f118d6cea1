"""Fault isolation in the serving engine (lm/serving): an exception while admitting,
prefilling, sampling or decoding fails the requests it belongs to, and the engine goes on."""

import pytest
import torch

import mm
from lm import SamplingParams
from lm.serving import runner as runner_module
from lm.serving import Engine, EngineClosedError
from lm.serving.scheduler import Scheduler
from tests.lm.serving.test_scheduler import _alone, _prompt


@pytest.fixture(scope="module")
def lm_moe(checkpoints):
    return mm.load_model(checkpoints("moe_text")[1]).lm


def _unchecked(**fields) -> SamplingParams:
    """SamplingParams with fields set past its checks (what a caller bypassing them would pass)."""
    params = SamplingParams(max_new_tokens=4)
    for name, value in fields.items():
        object.__setattr__(params, name, value)
    return params


def _raise_at(n: int):
    def rule(tokens):
        if len(tokens) == n:
            raise RuntimeError(f"a rule failed at token {n}")
        return None

    return rule


def test_seed_out_of_range_is_refused_with_its_name():
    for seed in (1 << 64, 10**100, -(1 << 63) - 1, 1.5):
        with pytest.raises(ValueError, match="seed must be an integer"):
            SamplingParams(seed=seed)
    SamplingParams(seed=(1 << 64) - 1)  # the extremes are taken
    SamplingParams(seed=-(1 << 63))
    with pytest.raises(ValueError, match="max_new_tokens must be <="):
        SamplingParams(max_new_tokens=1 << 40)


def test_a_fault_in_each_phase_fails_that_request_only(lm_moe):
    engine = Engine(lm_moe, max_batch=4, step_tokens=16, prefix_cache_bytes=1 << 20)
    goods = [(_prompt(100 + i, 7 + 5 * i), 10) for i in range(3)]
    handles = [engine.submit(ids, SamplingParams(max_new_tokens=m)) for ids, m in goods]
    bad = {
        "admission": engine.submit(_prompt(1, 9), _unchecked(seed=1 << 70, temperature=1.0)),
        "first token": engine.submit(_prompt(2, 9), SamplingParams(max_new_tokens=6), rule=_raise_at(0)),
        "decode sampling": engine.submit(_prompt(3, 30), SamplingParams(max_new_tokens=6), rule=_raise_at(3)),
        "stop check": engine.submit(_prompt(4, 5), SamplingParams(max_new_tokens=6),
                                    stop_when=lambda tokens: 1 / 0 if len(tokens) == 2 else False),
    }  # fmt: skip
    late = engine.submit(_prompt(5, 12), SamplingParams(max_new_tokens=8))
    for phase, handle in bad.items():
        with pytest.raises((ValueError, RuntimeError, ZeroDivisionError)):
            handle.result()
        assert handle.error is not None, phase
    for (ids, m), handle in zip(goods, handles):
        assert handle.result() == _alone(lm_moe, ids, m)
    assert late.result() == _alone(lm_moe, _prompt(5, 12), 8)
    stats = engine.stats()
    assert stats["alive"] and stats["failed"] == 4 and stats["running"] == 0
    assert engine.store.lengths.sum() == 0  # every slot freed, the failed ones too
    engine.close()


def test_a_failed_decode_step_fails_its_rows_and_the_engine_goes_on(lm_moe, monkeypatch):
    engine = Engine(lm_moe, max_batch=2, prefix_cache_bytes=0)
    real = runner_module.step_tokens
    calls = {"n": 0}

    def flaky(*args):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("a decode step failed")
        return real(*args)

    monkeypatch.setattr(runner_module, "step_tokens", flaky)
    first = engine.submit(_prompt(20, 8), SamplingParams(max_new_tokens=8))
    with pytest.raises(RuntimeError, match="decode step failed"):
        first.result()
    after = engine.submit(_prompt(21, 8), SamplingParams(max_new_tokens=5))
    assert after.result() == _alone(lm_moe, _prompt(21, 8), 5)
    assert engine.alive and engine.store.lengths.sum() == 0
    engine.close()


def test_a_dead_engine_thread_is_reported_and_refuses_new_requests(lm_moe, monkeypatch):
    engine = Engine(lm_moe, prefix_cache_bytes=0)

    def fatal(self):
        raise SystemExit("the loop itself broke")

    monkeypatch.setattr(Scheduler, "step", fatal)
    doomed = engine.submit(_prompt(30, 6), SamplingParams(max_new_tokens=3))
    with pytest.raises(EngineClosedError, match="the engine stopped"):
        doomed.result()
    engine.join(timeout=30)
    assert not engine.alive and "loop itself broke" in str(engine.dead)
    with pytest.raises(EngineClosedError, match="the engine stopped"):
        engine.submit(_prompt(31, 6), SamplingParams(max_new_tokens=3))
