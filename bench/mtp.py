"""Speculative decoding with the MTP layer (lm/serving/speculative.py): what one step costs.

    python -m bench.mtp [--config 35b|0.8b] [--layers N] [--weights int4] [--batches 1,4,8]
                        [--k 1,2,3] [--new 24] [--rounds 2]

The model is built from a real config (tests/data/reference; `--layers N` keeps its first N
layers) with its MTP layer and random weights, straight in the storage format (bench.big's build,
no checkpoint written). Random weights draft tokens the main model never picks (acceptance ~0:
real acceptance cannot be shown here), so a speculative step yields one token per row and costs
what drafting K tokens, verifying K + 1 and rolling back cost. Its time against a plain decode step
of the same batch (in turns, best of `--rounds`) is the ratio r; the expected speedup at a per-draft
acceptance a (drafts accepted independently, each with probability a) is E / r with
E = (1 - a^(K+1)) / (1 - a) tokens per step.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from bench.big import CONFIG, fill_random
from lm import SamplingParams, kernels, stream_generate
from lm.formats import policy
from lm.serving import SpeculativeStats
from mm.config import ModelConfig
from mm.loading import allocate, set_compute
from mm.model import VLModel

CONFIGS = {"35b": CONFIG, "0.8b": CONFIG.with_name("qwen3.5-0.8b.config.json")}
ACCEPTANCE = (0.6, 0.8, 0.9)


def build(config_name: str, layers: int | None, weights: str, k: int) -> VLModel:
    """The model of a reference config (first `layers` layers) with its MTP layer drafting k tokens,
    random weights in the storage of `weights` (a one-block vision tower, unused)."""
    raw = json.loads(CONFIGS[config_name].read_text())
    text = raw.get("text_config", raw)
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


def per_step(lm, batch: int, new: int, k: int) -> tuple[float, float]:
    """Seconds per decode step after the prompt's (row 0's first token) with k drafts (0: plain),
    and the new tokens per step the generation made."""
    lm.num_speculative_tokens = k
    stats = SpeculativeStats()
    ids = torch.randint(0, 1000, (batch, 8), generator=torch.Generator().manual_seed(batch))
    params = SamplingParams(max_new_tokens=new, temperature=0.0)
    stamps = [time.perf_counter() for e in stream_generate(lm, ids, params, stats=stats if k else None) if e.row == 0]
    steps = stats.steps if k else len(stamps) - 1  # each verify forward after the prompt's / each step
    return (stamps[-1] - stamps[0]) / max(1, steps), stats.tokens_per_step if k else 1.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="35b", choices=sorted(CONFIGS))
    parser.add_argument("--layers", type=int, default=None, help="keep the first N layers (default: all)")
    parser.add_argument("--weights", default="int4")
    parser.add_argument("--batches", default="1,4,8")
    parser.add_argument("--k", default="1,2,3")
    parser.add_argument("--new", type=int, default=24)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    ks = [int(k) for k in args.k.split(",")]
    started = time.perf_counter()
    model = build(args.config, args.layers, args.weights, max(ks))
    layers = model.config.text.num_hidden_layers
    print(f"{args.config} config, {layers} layers + MTP, {args.weights} weights, random: built in "
          f"{time.perf_counter() - started:.0f} s; threads {torch.get_num_threads()}", flush=True)
    with torch.no_grad():
        for batch in (int(b) for b in args.batches.split(",")):
            best: dict[int, float] = {}
            made: dict[int, float] = {}
            for _ in range(args.rounds):
                for k in [0, *ks]:
                    seconds, made[k] = per_step(model.lm, batch, args.new, k)
                    best[k] = min(best.get(k, float("inf")), seconds)
            for k in ks:
                r = best[k] / best[0]
                gains = ", ".join(f"{(1 - a ** (k + 1)) / (1 - a) / r:.2f}x at {a}" for a in ACCEPTANCE)
                print(f"batch {batch}, K={k}: step {best[k] * 1e3:.1f} ms against decode {best[0] * 1e3:.1f} ms "
                      f"({r:.2f}x; {made[k]:.2f} tokens a step here); expected speedup {gains}", flush=True)


if __name__ == "__main__":
    main()
