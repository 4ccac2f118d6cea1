"""Where one batch-1 decode step goes: the step, its layers, the LM head and the layers' parts.

    python -m bench.step_parts --checkpoint DIR [--weights int4] [--rounds 3]

Loads a checkpoint in one format and builds its decode plan (lm/decode.py) on a short prompt, then
per round, with the read bandwidth probed before it:
- a greedy generation (ms per token, and the time per token outside its C++ steps: the Python
  around them, sampling and cache bookkeeping), the whole C++ step alone (`DecodePlan.step`:
  embeddings, layers, final norm, LM head);
- the layers alone (`DecodePlan.run`) and the LM head product alone;
- each part of the layers over all layers in turn: the DeltaNet input projections (one call), its
  token step (conv, gates, delta rule, norm; its state read and written), out_proj; the attention
  projections; the MoE blocks (`moe_decode`) or dense MLPs; the RMS norms; with the bytes each
  reads (and writes, for the states) per second.
Medians of `--calls` calls each, each call after a read of 4x the last-level cache (untimed), so
that its weights and states come from memory, as in a step. The parts do not add up to the step
exactly: a step's parts run after one another, warming each other's caches, and the memory state
moves between rounds.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

import mm
from bench.limits import CacheEvictor, ReadBandwidth
from bench.lm import median
from lm import SamplingParams, decode, kernels, stream_generate
from lm.formats import stored
from lm.serving import runner
from lm.moe import SparseMoeBlock


def w(module, name: str = "weight") -> tuple[torch.Tensor, int]:
    """`module`'s weight `name` as the kernels take it: (storage, format code)."""
    return kernels.weight_arg(stored(module, name))


def nbytes(*tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def median_time(fn, calls: int, before=None) -> float:
    """Median seconds of `calls` calls of `fn`, each after `before()` (untimed) when given."""
    def once() -> float:
        if before is not None:
            before()
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start

    return median([once() for _ in range(calls)])


class TimedPlan:
    """A decode plan whose `step_tokens` calls (the generation's C++ steps) add up their time."""

    def __init__(self, plan):
        self.plan, self.seconds, self.calls = plan, 0.0, 0

    def step_tokens(self, *args):
        start = time.perf_counter()
        try:
            return self.plan.step_tokens(*args)
        finally:
            self.seconds += time.perf_counter() - start
            self.calls += 1


def generation(lm, ids, new: int) -> tuple[float, float]:
    """A greedy generation of `new` tokens: (seconds a token, seconds a token outside the C++ steps),
    over the steps after the first (which builds the plan and runs through the model)."""
    timed = []

    def timed_step(cache, tokens, positions, lengths=None):
        if not timed and (plan := decode._step_plans.get(cache)) is not None:
            timed.append(TimedPlan(plan))
            decode._step_plans[cache] = timed[0]
        return decode.step_tokens(cache, tokens, positions, lengths)

    runner.step_tokens = timed_step
    try:
        stamps = [time.perf_counter() for e in stream_generate(lm, ids, SamplingParams(max_new_tokens=new))]
    finally:
        runner.step_tokens = decode.step_tokens
    steps = len(stamps) - 2  # events 2.. each follow one step_tokens call
    if not timed or timed[0].calls != steps:
        raise SystemExit("the generation did not decode through step_tokens; nothing to measure")
    per_token = (stamps[-1] - stamps[1]) / steps
    return per_token, per_token - timed[0].seconds / steps


def layer_parts(k, lm, cache, cfg) -> dict:
    """name -> (function running the part over every layer that has it, bytes it moves)."""
    layers, slots, eps = lm.model.layers, list(cache.slots.values()), cfg.rms_norm_eps
    x = torch.randn(1, lm.model.norm.weight.numel())
    deltanet = [(layer.linear_attn, slot) for layer, slot in zip(layers, slots) if layer.layer_type == "linear_attention"]
    attention = [layer.self_attn for layer in layers if layer.layer_type != "linear_attention"]
    mlps = [layer.mlp for layer in layers]
    parts = {}
    if deltanet:
        def inputs(a):
            return [w(a.in_proj_qkv), w(a.in_proj_z), w(a.in_proj_b), w(a.in_proj_a)]

        a0 = deltanet[0][0]
        p = k.multi_linear(x, inputs(a0))
        out = torch.randn(1, p[1].shape[1])
        parts["DeltaNet input projections"] = (lambda: [k.multi_linear(x, inputs(a)) for a, _ in deltanet],
                                               sum(nbytes(*(t for t, _ in inputs(a))) for a, _ in deltanet))

        def token_steps():
            for a, s in deltanet:
                conv = a.conv1d.weight
                k.gdn_decode(p[0], p[1], p[2], p[3], s.conv, conv.view(conv.shape[0], -1), a.A_log, a.dt_bias,
                             s.recurrent, a.norm.weight, eps, a.num_k_heads)

        parts["DeltaNet token step"] = (token_steps, sum(2 * nbytes(s.recurrent, s.conv) for _, s in deltanet))
        parts["DeltaNet out_proj"] = (lambda: [k.multi_linear(out, [w(a.out_proj)]) for a, _ in deltanet],
                                      sum(nbytes(a.out_proj.weight) for a, _ in deltanet))
    if attention:
        def qkv(a):
            return [w(a.q_proj), w(a.k_proj), w(a.v_proj)]

        o_in = torch.randn(1, cfg.num_attention_heads * cfg.head_dim)
        parts["attention projections"] = (
            lambda: [(k.multi_linear(x, qkv(a)), k.multi_linear(o_in, [w(a.o_proj)])) for a in attention],
            sum(nbytes(*(t for t, _ in qkv(a)), a.o_proj.weight) for a in attention))
    if isinstance(mlps[0], SparseMoeBlock):
        def moe():
            for m in mlps:
                s = m.shared_expert
                k.moe_decode(x, w(m.gate), w(m.experts, "gate_up_proj"), w(m.experts, "down_proj"), m.gate.top_k,
                             w(s.gate_proj), w(s.up_proj), w(s.down_proj), m.shared_expert_gate.weight,
                             kernels.moe_pieces())

        def moe_bytes(m):  # the top-k experts (one token), the shared expert and the router
            share = m.gate.top_k / m.experts.gate_up_proj.shape[0]
            s = m.shared_expert
            return (share * nbytes(m.experts.gate_up_proj, m.experts.down_proj)
                    + nbytes(s.gate_proj.weight, s.up_proj.weight, s.down_proj.weight, m.gate.weight))

        parts["MoE blocks"] = (moe, sum(moe_bytes(m) for m in mlps))
    else:
        h = torch.randn(1, cfg.intermediate_size)
        parts["dense MLPs"] = (
            lambda: [(k.multi_linear(x, [w(m.gate_proj), w(m.up_proj)]), k.multi_linear(h, [w(m.down_proj)]))
                     for m in mlps],
            sum(nbytes(m.gate_proj.weight, m.up_proj.weight, m.down_proj.weight) for m in mlps))
    norms = [w for layer in layers for w in (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)]
    parts["RMS norms"] = (lambda: [k.rms_norm(x, w, eps, 1.0) for w in norms], 0)
    return parts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--checkpoint", type=Path, required=True)
    parser.add_argument("--weights", default="int4")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--calls", type=int, default=15)
    args = parser.parse_args()
    k = kernels._kernels()
    if k is None:
        raise SystemExit("the CPU kernels are off or not built (QWEN35_CPU_KERNELS); nothing to measure")
    model = mm.load_model(args.checkpoint, weights=args.weights)
    lm = model.lm
    ids = torch.randint(0, model.config.text.vocab_size, (1, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        cache = lm.make_cache(1, 64)
        lm(ids, cache=cache, last_only=True)
        lm(ids[:, -1:], cache=cache)  # one decode step: builds the cache's plan
    plan = decode._step_plans.get(cache)
    if plan is None:
        raise SystemExit("this model has no decode plan (see the message above); nothing to measure")
    states = decode._states(cache)
    keep, pos = decode._keep_and_pos(cache, None)
    step_ids, positions = ids[:, -1], torch.full((3, 1), cache.length, dtype=torch.long)
    hidden = torch.randn(1, lm.model.norm.weight.numel())
    angles = 2 * lm.model.rotary_emb.inv_freq.numel()
    rotary = torch.ones(1, angles), torch.zeros(1, angles)
    head = lm.lm_head.weight
    parts = layer_parts(k, lm, cache, model.config.text)
    probe, evict = ReadBandwidth(1.0), CacheEvictor()
    print(f"{args.checkpoint.name}, {args.weights}, batch 1, {torch.get_num_threads()} threads; "
          f"LM head {nbytes(head) / 1e6:.0f} MB")
    for _ in range(args.rounds):
        bandwidth = probe(2)
        per_token, python = generation(lm, ids, 25)
        step = median_time(lambda: plan.step(step_ids, positions, states, keep, pos), args.calls, evict)
        layers = median_time(lambda: plan.run(hidden, states, *rotary, keep, pos), args.calls, evict)
        lm_head = median_time(lambda: k.multi_linear(hidden, [w(lm.lm_head)]), args.calls, evict)
        print(f"probe {bandwidth / 1e9:.0f} GB/s: generation {per_token * 1e3:.2f} ms a token (Python around its "
              f"C++ steps {python * 1e3:.2f} ms), step "
              f"{step * 1e3:.2f} ms, layers {layers * 1e3:.2f} ms, LM head {lm_head * 1e3:.2f} ms "
              f"({nbytes(head) / lm_head / 1e9:.0f} GB/s)")
        for name, (fn, moved) in parts.items():
            t = median_time(fn, args.calls, evict)
            rate = f", {moved / t / 1e9:.0f} GB/s" if moved else ""
            print(f"  {name:28s} {t * 1e3:6.2f} ms{rate}")


if __name__ == "__main__":
    main()
