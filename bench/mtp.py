"""Speculative decoding with the MTP layer (lm/serving/speculative.py): what one step costs.

    python -m bench.mtp [--config 35b|0.8b|27b] [--layers N] [--weights int4] [--batches 1,4,8]
                        [--k 1,2,3] [--new 24] [--rounds 2] [--engine] [--checkpoint DIR]

The model is built from a real config (tests/data/reference; 27b: the 0.8B config with
Qwen3.5-27B's sizes: 64 layers, hidden 5120, 24 / 4 attention heads, 48 DeltaNet value heads, MLP
17408, untied head; `--layers N` keeps its first N layers) with its MTP layer and random weights, straight
in the storage format (bench.big's build, no checkpoint written), or read from `--checkpoint DIR`
(one with its `mtp.*` layer; with real weights the tokens a step show the real acceptance). Random weights draft tokens the main model never picks (acceptance ~0:
real acceptance cannot be shown here), so a speculative step yields one token per row and costs
what drafting K tokens, verifying K + 1 and rolling back cost. Its time against a plain decode step
of the same batch (in turns, best of `--rounds`) is the ratio r; the expected speedup at a per-draft
acceptance a (drafts accepted independently, each with probability a) is E / r with
E = (1 - a^(K+1)) / (1 - a) tokens per step. The step's parts are timed too: drafting (the MTP
layer and the LM head, K times), the verify forward of K + 1 tokens a row (against the decode step:
the verify(K + 1) / step ratio), and the rest (accepting, the rollback's state copies).
`--engine` measures the serving engine instead (lm/serving/drafts.py: each row drafts on its own
MTP cache): B requests together, decode tokens a second with and without drafts, in turns, and
the drafts' acceptance (with random weights ~0: then the ratio is a step's cost).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from bench.big import CONFIG, fill_random
from lm import SamplingParams, decode, kernels, stream_generate
from lm.formats import policy
from lm.serving import Engine, SpeculativeStats, speculative
from mm.config import ModelConfig
from mm.loading import allocate, load_model, set_compute
from mm.model import VLModel

CONFIGS = {"35b": CONFIG, "0.8b": CONFIG.with_name("qwen3.5-0.8b.config.json"), "27b": None}
SIZES_27B = dict(hidden_size=5120, num_attention_heads=24, num_key_value_heads=4, linear_num_value_heads=48,
                 intermediate_size=17408, tie_word_embeddings=False)  # Qwen3.5 / Qwen3.6-27B's config
ACCEPTANCE = (0.6, 0.8, 0.9)


def build(config_name: str, layers: int | None, weights: str, k: int) -> VLModel:
    """The model of a reference config (first `layers` layers) with its MTP layer drafting k tokens,
    random weights in the storage of `weights` (a one-block vision tower, unused)."""
    raw = json.loads((CONFIGS[config_name] or CONFIGS["0.8b"]).read_text())
    text = raw.get("text_config", raw)
    if config_name == "27b":
        text.update(SIZES_27B, num_hidden_layers=64)
        text["layer_types"] = (["linear_attention"] * 3 + ["full_attention"]) * 16
        raw["tie_word_embeddings"] = False
        raw["vision_config"]["out_hidden_size"] = SIZES_27B["hidden_size"]
    if layers:
        text["num_hidden_layers"] = layers
        text["layer_types"] = text["layer_types"][:layers]
    raw["vision_config"]["depth"] = 1  # the tower is not used here
    config = ModelConfig.from_hf(raw)
    with torch.device("meta"):
        model = VLModel(config)
        model.lm.add_mtp(k)
    shapes = {n: tuple(p.shape) for n, p in model.lm.named_parameters(remove_duplicate=False)}
    formats = policy.plan(shapes, weights, torch.bfloat16, groups=kernels.bf16_groups())
    model = allocate(model, formats, "cpu").eval().requires_grad_(False)
    fill_random(model, {f"lm.{n}": f for n, f in formats.items()})
    set_compute("auto", model)
    return model


class Parts:
    """Seconds spent in the speculative steps that drafted `k` tokens, and in their drafting and
    verify forwards (speculative._step, .draft, decode.verify_logits, wrapped while a generation
    runs; a row's last step, with no token left to draft for, is not counted)."""

    def __init__(self, k: int):
        self.k, self.steps = k, 0
        self.seconds = {"step": 0.0, "draft": 0.0, "verify": 0.0}

    def __enter__(self):
        self.saved = speculative._step, speculative.draft, decode.verify_logits
        speculative._step = self._step(self.saved[0])
        speculative.draft = self._timed("draft", self.saved[1])
        decode.verify_logits = self._timed("verify", self.saved[2])
        return self

    def __exit__(self, *exc):
        speculative._step, speculative.draft, decode.verify_logits = self.saved

    def _step(self, fn):
        def step(lm, cache, mtp_cache, rows, sampler, outputs, k, stats):
            start, before = time.perf_counter(), dict(self.seconds)
            try:
                return fn(lm, cache, mtp_cache, rows, sampler, outputs, k, stats)
            finally:
                if k == self.k:
                    self.seconds["step"] += time.perf_counter() - start
                    self.steps += 1
                else:  # fewer drafts near the end: not this K's step
                    self.seconds = before

        return step

    def _timed(self, part, fn):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[part] += time.perf_counter() - start

        return timed


def per_step(lm, batch: int, new: int, k: int) -> tuple[float, float, dict]:
    """Seconds per decode step after the prompt's (row 0's first token) with k drafts (0: plain),
    the share of drafts accepted, and seconds per step in each part."""
    lm.num_speculative_tokens = k
    stats = SpeculativeStats()
    ids = torch.randint(0, 1000, (batch, 8), generator=torch.Generator().manual_seed(batch))
    params = SamplingParams(max_new_tokens=new, temperature=0.0)
    with Parts(k) as parts:
        stamps = [time.perf_counter() for e in stream_generate(lm, ids, params, stats=stats if k else None)
                  if e.row == 0]  # fmt: skip
    if not k:
        return (stamps[-1] - stamps[0]) / (len(stamps) - 1), 0.0, {}
    steps = max(1, parts.steps)
    return parts.seconds["step"] / steps, stats.acceptance, {n: t / steps for n, t in parts.seconds.items()}


def engine_rate(lm, batch: int, new: int, k: int) -> tuple[float, float]:
    """Decode tokens a second of `batch` greedy requests together in the serving engine with k drafts
    a step (0: none): the tokens of all rows between the last first token and the first last one;
    and the share of drafts accepted."""
    lm.num_speculative_tokens = k
    engine = Engine(lm, max_batch=batch, prefix_cache_bytes=0)
    try:
        prompts = torch.randint(0, 1000, (batch, 8), generator=torch.Generator().manual_seed(batch)).tolist()
        requests = [engine.submit(ids, SamplingParams(max_new_tokens=new)) for ids in prompts]
        for r in requests:
            r.result()
        accepted = engine.counters["accepted"] / max(1, engine.counters["drafted"])
    finally:
        engine.close()
    start = max(r.token_times[0] for r in requests)
    end = min(r.token_times[-1] for r in requests)
    made = sum(sum(start < t <= end for t in r.token_times) for r in requests)
    return made / (end - start), accepted


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="35b", choices=sorted(CONFIGS))
    parser.add_argument("--layers", type=int, default=None, help="keep the first N layers (default: all)")
    parser.add_argument("--weights", default="int4")
    parser.add_argument("--batches", default="1,4,8")
    parser.add_argument("--k", default="1,2,3")
    parser.add_argument("--new", type=int, default=24)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--engine", action="store_true", help="measure the serving engine's decode rate instead")
    parser.add_argument("--checkpoint", default=None, help="a checkpoint directory with its MTP layer instead")
    args = parser.parse_args()
    ks = [int(k) for k in args.k.split(",")]
    started = time.perf_counter()
    if args.checkpoint:
        model = load_model(args.checkpoint, weights=args.weights, speculative="mtp", num_speculative_tokens=max(ks))
        what = f"{args.checkpoint}, {model.config.text.num_hidden_layers} layers + MTP, {args.weights} weights: loaded"
    else:
        model = build(args.config, args.layers, args.weights, max(ks))
        layers = model.config.text.num_hidden_layers
        what = f"{args.config} config, {layers} layers + MTP, {args.weights} weights, random: built"
    print(f"{what} in {time.perf_counter() - started:.0f} s; threads {torch.get_num_threads()}", flush=True)
    with torch.no_grad():
        for batch in (int(b) for b in args.batches.split(",")) if args.engine else ():
            rates: dict[int, float] = {}
            accepted: dict[int, float] = {}
            for _ in range(args.rounds):
                for k in [0, *ks]:
                    rate, accepted[k] = engine_rate(model.lm, batch, args.new, k)
                    rates[k] = max(rates.get(k, 0.0), rate)
            for k in ks:
                r = rates[0] / rates[k]  # with acceptance ~0 (random weights): a step's cost against a plain one
                gains = ", ".join(f"{(1 - a ** (k + 1)) / (1 - a) / r:.2f}x at {a}" for a in ACCEPTANCE)
                print(f"engine, batch {batch}, K={k}: {rates[k]:.1f} against {rates[0]:.1f} decode tok/s without "
                      f"drafts ({accepted[k]:.0%} of the drafts accepted; rates' ratio {r:.2f}x, a step's cost when "
                      f"none is accepted: expected speedup {gains})", flush=True)  # fmt: skip
        for batch in (int(b) for b in args.batches.split(",")) if not args.engine else ():
            best: dict[int, float] = {}
            made: dict[int, float] = {}
            parts: dict[int, dict] = {}
            for _ in range(args.rounds):
                for k in [0, *ks]:
                    seconds, made[k], split = per_step(model.lm, batch, args.new, k)
                    if seconds < best.get(k, float("inf")):
                        best[k], parts[k] = seconds, split
            for k in ks:
                r = best[k] / best[0]
                gains = ", ".join(f"{(1 - a ** (k + 1)) / (1 - a) / r:.2f}x at {a}" for a in ACCEPTANCE)
                draft, verify = parts[k]["draft"], parts[k]["verify"]
                print(f"batch {batch}, K={k}: step {best[k] * 1e3:.1f} ms against decode {best[0] * 1e3:.1f} ms "
                      f"({r:.2f}x; {made[k]:.0%} of the drafts accepted here); expected speedup {gains}\n"
                      f"    draft {draft * 1e3:.1f} ms, verify({k + 1}) {verify * 1e3:.1f} ms = "
                      f"{verify / best[0]:.2f}x the decode step, the rest {(best[k] - draft - verify) * 1e3:.1f} ms",
                      flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
