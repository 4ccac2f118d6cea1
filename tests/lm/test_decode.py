"""The CPU decode fast path (lm/decode.py) against the layer-by-layer reference path."""

import pytest
import torch

import lm.serving.runner
import lm.model
import mm
from lm import SamplingParams, stream_generate
from lm.decode import step_tokens
from tests.conftest import count_step_tokens, rel_err


def _decode_logits(model, ids, steps: int) -> torch.Tensor:
    """Prefill ids[:, :-steps], then one token per row per step: logits [B, T, V]."""
    cache = model.lm.make_cache(ids.shape[0], ids.shape[1])
    prompt = ids.shape[1] - steps
    with torch.no_grad():
        out = [model.lm(ids[:, :prompt], cache=cache)]
        out += [model.lm(ids[:, i : i + 1], cache=cache) for i in range(prompt, ids.shape[1])]
    return torch.cat(out, 1)


def _count_fast_steps(monkeypatch) -> list[bool]:
    """A list that records, for each decode step from now on, whether it took the fast path: the
    one-call step from token ids (decode_logits) or, where that does not apply, the layers' one
    (decode_layers, which the model calls after decode_logits declined)."""
    used, layers, logits = [], lm.model.decode_layers, lm.model.decode_logits

    def counting_layers(*args):
        out = layers(*args)
        used.append(out is not None)
        return out

    def counting_logits(*args):
        out = logits(*args)
        if out is not None:
            used.append(True)
        return out

    monkeypatch.setattr(lm.model, "decode_layers", counting_layers)
    monkeypatch.setattr(lm.model, "decode_logits", counting_logits)
    return used


@pytest.mark.parametrize("kind,batch,weights", [("moe_text", 3, "auto"), ("dense_vl", 3, "auto"), ("moe_text", 6, "auto"),
                                                 ("dense_vl", 8, "auto"), ("dense_vl", 8, "bf16")])
def test_fast_decode_equals_reference_layers(checkpoints, monkeypatch, kind, batch, weights):
    """Batches of 6 and 8 stream panel copies of the mixers', dense MLPs' and LM head's weights (of
    bf16 weights, bf16 copies)."""
    _, path = checkpoints(kind)
    model = mm.load_model(path, weights=weights, compute="fp32")  # prefill in float32, as the reference layers
    monkeypatch.setattr(lm.kernels, "MIN_WEIGHT_ELEMENTS", 0)  # the tiny weights take the kernels too
    monkeypatch.setattr(lm.kernels, "panel_rows", lambda: 5)  # panels on whatever this CPU's default
    ids = torch.randint(3, 500, (batch, 14), generator=torch.Generator().manual_seed(11))
    used = _count_fast_steps(monkeypatch)
    monkeypatch.setenv("QWEN35_CPU_KERNELS", "1")
    ours = _decode_logits(model, ids, steps=6)
    assert used == [True] * 6  # every decode step took the fast path
    monkeypatch.setenv("QWEN35_CPU_KERNELS", "0")  # the reference layers, no kernels at all
    reference = _decode_logits(model, ids, steps=6)
    assert used[6:] == [False] * 6
    assert rel_err(ours, reference) < 1e-5
    if batch >= 5:  # the panel copies are what the step reads
        monkeypatch.setenv("QWEN35_CPU_KERNELS", "1")
        for copy in lm.kernels.panel_copies():
            copy.zero_()
        assert rel_err(_decode_logits(model, ids, steps=6)[:, -6:], reference[:, -6:]) > 0.1


def test_fast_decode_steps_aside_when_it_does_not_apply(checkpoints, monkeypatch):
    _, path = checkpoints("moe_text")
    model = mm.load_model(path)
    monkeypatch.setenv("QWEN35_CPU_KERNELS", "1")
    cache = model.lm.make_cache(9, 2)
    x = torch.randn(9, 1, model.lm.config.hidden_size)  # more rows than the decode kernels take
    assert lm.model.decode_layers(model.lm.model, x, cache, None, None) is None
    assert lm.model.decode_layers(model.lm.model, x[:2].double(), cache, None, None) is None


@pytest.mark.parametrize("heads,kv", [(6, 2), (12, 2)])  # 3 and 6 query heads per KV head (Qwen3.5-27B: 24 / 4)
def test_fast_decode_takes_any_head_ratio(monkeypatch, heads, kv):
    from lm.config import TextConfig
    from lm.model import CausalLM
    from tests import tiny

    config = TextConfig.from_hf(tiny.text_config(True, num_attention_heads=heads, num_key_value_heads=kv))
    lm_model = CausalLM(config).eval()
    g = torch.Generator().manual_seed(heads)
    with torch.no_grad():  # matrices of std 0.3 over 64 inputs grew the activations 2.4x a layer and the
        for p in lm_model.parameters():  # rounding with them (1.1e-5 with AVX-512, 0.8e-5 with AVX2, one step)
            p.copy_(torch.randn(p.shape, generator=g) * (0.3 if p.ndim == 1 else 0.1))

    class Wrapped:  # _decode_logits takes a loaded model (model.lm)
        lm = lm_model

    ids = torch.randint(3, 500, (2, 9), generator=g)
    used = _count_fast_steps(monkeypatch)
    monkeypatch.setenv("QWEN35_CPU_KERNELS", "1")
    ours = _decode_logits(Wrapped, ids, steps=4)
    assert used == [True] * 4
    monkeypatch.setenv("QWEN35_CPU_KERNELS", "0")
    assert rel_err(ours, _decode_logits(Wrapped, ids, steps=4)) < 1e-5


def test_fast_decode_after_a_left_padded_prompt_equals_reference(checkpoints, monkeypatch):
    """Padding in the cache: the attention kernel gets the key mask, padded keys stay unseen."""
    _, path = checkpoints("moe_vl")
    model = mm.load_model(path)
    ids = torch.randint(3, 500, (2, 10), generator=torch.Generator().manual_seed(4))
    mask = torch.ones(2, 6, dtype=torch.long)
    mask[1, :3] = 0

    def run():
        cache = model.lm.make_cache(2, 10)
        with torch.no_grad():
            out = [model.lm(ids[:, :6], attention_mask=mask, cache=cache)[:, -1:]]
            positions = mask.sum(-1)  # next text position of each row
            for i in range(6, 10):
                pos = (positions + i - 6)[None, :, None].expand(3, -1, 1)
                out.append(model.lm(ids[:, i : i + 1], positions=pos, cache=cache))
        return torch.cat(out, 1)

    monkeypatch.setenv("QWEN35_CPU_KERNELS", "1")
    ours = run()
    monkeypatch.setenv("QWEN35_CPU_KERNELS", "0")
    assert rel_err(ours, run()) < 1e-5


def test_fast_decode_with_attention_biases_equals_reference(monkeypatch):
    """q/k/v/o projection biases (attention_bias=True) go through the layer's own projections."""
    from lm.config import TextConfig
    from lm.model import CausalLM
    from tests import tiny

    config = TextConfig.from_hf(tiny.text_config(True, attention_bias=True))
    lm_model = CausalLM(config).eval()
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in lm_model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    assert lm_model.model.layers[3].self_attn.q_proj.bias is not None

    class Wrapped:  # _decode_logits takes a loaded model (model.lm)
        lm = lm_model

    ids = torch.randint(3, 500, (2, 9), generator=g)
    monkeypatch.setenv("QWEN35_CPU_KERNELS", "1")
    ours = _decode_logits(Wrapped, ids, steps=4)
    monkeypatch.setenv("QWEN35_CPU_KERNELS", "0")
    assert rel_err(ours, _decode_logits(Wrapped, ids, steps=4)) < 1e-5


def test_one_call_step_refuses_a_token_outside_the_vocabulary(checkpoints, monkeypatch):
    """decode_logits gathers the embedding rows itself: an id past the table is the same IndexError
    as the embedding layer's, and the cache stays usable."""
    _, path = checkpoints("moe_text")
    model = mm.load_model(path)
    vocab = model.lm.config.vocab_size
    for switch in ("1", "0"):
        monkeypatch.setenv("QWEN35_CPU_KERNELS", switch)
        cache = model.lm.make_cache(1, 8)
        with torch.no_grad():
            model.lm(torch.tensor([[5, 6]]), cache=cache)
            with pytest.raises(IndexError):
                model.lm(torch.tensor([[vocab]]), cache=cache)
            assert cache.length == 2
            assert torch.isfinite(model.lm(torch.tensor([[7]]), cache=cache)).all()


def test_decode_steps_from_python_ints_equal_the_models(checkpoints, monkeypatch):
    """step_tokens (the engine's decode loop; tokens and positions as Python ints) gives the logits
    and the cache of the model's own decode step, after a left-padded prompt (the key mask) and
    after a row is dropped (cache.keep); with no plan yet (a fresh cache) it declines."""
    _, path = checkpoints("moe_vl")
    model = mm.load_model(path)
    monkeypatch.setenv("QWEN35_CPU_KERNELS", "1")
    ids = torch.randint(3, 500, (3, 10), generator=torch.Generator().manual_seed(5))
    mask = torch.ones(3, 6, dtype=torch.long)
    mask[1, :2] = 0

    def run(ints: bool):
        cache, out, rows = model.lm.make_cache(3, 10), [], [0, 1, 2]
        with torch.no_grad():
            model.lm(ids[:, :6], attention_mask=mask, cache=cache)
            positions = mask.sum(-1).tolist()
            for i in range(6, 10):
                if i == 8:
                    cache.keep(torch.tensor([0, 2]))
                    rows, positions = [0, 2], [positions[0], positions[2]]
                logits = step_tokens(cache, ids[rows, i].tolist(), positions) if ints else None
                assert (logits is None) == (not ints or i == 6)  # the model's first step makes the plan
                if logits is None:
                    pos = torch.tensor(positions)[None, :, None].expand(3, -1, 1)
                    logits = model.lm(ids[rows, i : i + 1], positions=pos, cache=cache)[:, -1]
                out.append(logits)
                positions = [p + 1 for p in positions]
        return out, cache

    (ours, cache), (theirs, reference) = run(True), run(False)
    assert all(rel_err(a, b) < 1e-6 for a, b in zip(ours, theirs))  # (the MoE threads take pieces in any order)
    assert cache.length == reference.length and torch.equal(cache.key_mask, reference.key_mask)


def test_generation_decodes_through_python_ints(checkpoints, monkeypatch):
    """stream_generate takes step_tokens for every decode step after the first, and its tokens
    equal the reference layers' (no kernels), rows finishing at different lengths included."""
    _, path = checkpoints("moe_text")
    model = mm.load_model(path)
    ids = torch.randint(3, 500, (2, 7), generator=torch.Generator().manual_seed(6))
    params = [SamplingParams(max_new_tokens=3), SamplingParams(max_new_tokens=6)]
    taken = count_step_tokens(monkeypatch, lm.serving.runner)

    def tokens():
        out = [[], []]
        for event in stream_generate(model.lm, ids, params):
            out[event.row].append(event.token)
        return out

    monkeypatch.setenv("QWEN35_CPU_KERNELS", "1")
    ours = tokens()
    assert taken == [False] + [True] * 4  # 5 decode steps: the first makes the plan
    monkeypatch.setenv("QWEN35_CPU_KERNELS", "0")
    assert ours == tokens() and [len(t) for t in ours] == [3, 6]


def test_plans_stepped_in_turns_equal_the_reference(checkpoints, monkeypatch):
    """A decode step keeps its activations in buffers of the calling thread, kept from step to step
    (decode_step.cpp): two plans of different models and batch sizes, stepped in turns in one
    thread, each give the logits of the reference layers."""
    monkeypatch.setattr(lm.kernels, "MIN_WEIGHT_ELEMENTS", 0)
    runs = []
    for kind, batch in (("moe_text", 1), ("dense_vl", 4)):  # the second needs larger buffers
        model = mm.load_model(checkpoints(kind)[1])
        runs.append((model, torch.randint(3, 500, (batch, 12), generator=torch.Generator().manual_seed(batch))))
    used = _count_fast_steps(monkeypatch)
    monkeypatch.setenv("QWEN35_CPU_KERNELS", "1")
    caches = [model.lm.make_cache(ids.shape[0], ids.shape[1]) for model, ids in runs]
    outs = [[] for _ in runs]
    with torch.no_grad():
        for (model, ids), cache, out in zip(runs, caches, outs):
            out.append(model.lm(ids[:, :7], cache=cache))
        for i in range(7, 12):  # one step of each model in turn
            for (model, ids), cache, out in zip(runs, caches, outs):
                out.append(model.lm(ids[:, i : i + 1], cache=cache))
    assert used == [True] * 10
    monkeypatch.setenv("QWEN35_CPU_KERNELS", "0")
    for (model, ids), out in zip(runs, outs):
        assert rel_err(torch.cat(out, 1), _decode_logits(model, ids, steps=5)) < 1e-5


def test_a_bad_cache_fails_the_step_before_any_layer_steps(checkpoints, monkeypatch):
    """The decode plan checks every layer's cache, and the positions against every KV cache, before
    the first layer steps: a step given a last KV cache too short for the position (or of the wrong
    shape), or a key mask that does not cover the keys, fails naming that layer, and no cache has
    moved, so the generation can go on."""
    from lm.cache import KVSlot
    from lm.decode import _states, _step_plans

    model = mm.load_model(checkpoints("moe_text")[1])
    monkeypatch.setenv("QWEN35_CPU_KERNELS", "1")
    ids = torch.randint(3, 500, (1, 6), generator=torch.Generator().manual_seed(7))
    cache = model.lm.make_cache(1, 8)
    with torch.no_grad():
        model.lm(ids[:, :5], cache=cache)
        model.lm(ids[:, 5:6], cache=cache)  # the first decode step makes the plan
    plan, states = _step_plans[cache], _states(cache)
    slots = list(cache.slots.values())
    last = max(i for i, s in enumerate(slots) if isinstance(s, KVSlot))
    assert any(not isinstance(s, KVSlot) for s in slots[:last])  # DeltaNet layers step before it
    before = [s.clone() for s in states]
    k, v = states[2 * last], states[2 * last + 1]
    for bad in ((k[:, :, :6].contiguous(), v[:, :, :6].contiguous()), (k[:, :1].contiguous(), v)):
        broken = states[: 2 * last] + list(bad) + states[2 * last + 2 :]
        with pytest.raises(RuntimeError, match=f"layer {last}"):
            plan.step_tokens([7], [6], broken, torch.empty(0, dtype=torch.bool), [6])
        assert all(torch.equal(a, b) for a, b in zip(states, before))
    with pytest.raises(RuntimeError, match=f"layer {last}: the key mask must cover 7 keys, not 5"):
        plan.step_tokens([7], [6], states, torch.ones(1, 5, dtype=torch.bool), [6])
    assert all(torch.equal(a, b) for a, b in zip(states, before))
    logits = plan.step_tokens([7], [6], states, torch.empty(0, dtype=torch.bool), [6])
    assert torch.isfinite(logits).all()
