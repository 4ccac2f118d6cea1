"""What picking sampled tokens costs on the real vocabulary: lm.sampling.draw beside torch.multinomial,
lm.sampling.largest (the kernels' top-k) beside torch.topk, and a whole Sampler call for a batch of
rows under the OpenAI API's defaults (temperature 1, no top-k / top-p / min-p) and under Qwen's
recommended settings (temperature 0.7, top-p 0.8, top-k 20; thinking: 0.6, 0.95, 20).

    python -m bench.sampling [--vocab 248320] [--rows 8] [--rounds 50]

Medians over `--rounds` calls, each on fresh softmax probabilities of random logits. A sampled row's
draw runs once per decode step, so beside the Sampler's figure: its share of a 200 ms step
(Qwen3.5-35B-A3B int4 at batch 8 on 2 cores: 37-42 tok/s in docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import statistics

import torch

from bench.limits import run_times
from lm import Sampler, SamplingParams
from lm.sampling import draw, largest

STEP_MS = 200.0


def median_ms(fn, rounds: int) -> float:
    return statistics.median(run_times(fn, rounds)) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", type=int, default=248_320)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=50)
    args = parser.parse_args()
    g = torch.Generator().manual_seed(0)
    probs = torch.softmax(torch.randn(args.vocab, generator=g) * 3, -1)
    ours = median_ms(lambda: draw(probs, g), args.rounds)
    theirs = median_ms(lambda: torch.multinomial(probs, 1, generator=g), args.rounds)
    print(f"one draw over {args.vocab} tokens: draw {ours:.3f} ms, torch.multinomial {theirs:.3f} ms "
          f"({theirs / ours:.1f}x)")
    scores = torch.randn(args.vocab, generator=g) * 3
    for k in (20, 1024):
        ours = median_ms(lambda: largest(scores, k), args.rounds)
        theirs = median_ms(lambda: torch.topk(scores, k), args.rounds)
        print(f"top-{k} of {args.vocab} logits: largest {ours:.3f} ms, torch.topk {theirs:.3f} ms ({theirs / ours:.1f}x)")
    logits = torch.randn(args.rows, args.vocab, generator=g) * 3
    rows, outputs = list(range(args.rows)), [[] for _ in range(args.rows)]
    settings = {"temperature 1": dict(temperature=1.0),
                "0.7 / top-p 0.8 / top-k 20": dict(temperature=0.7, top_p=0.8, top_k=20),
                "0.6 / top-p 0.95 / top-k 20": dict(temperature=0.6, top_p=0.95, top_k=20)}
    for name, kwargs in settings.items():
        sampler = Sampler([SamplingParams(seed=i, **kwargs) for i in range(args.rows)], [[]] * args.rows)
        step = median_ms(lambda: sampler(logits, rows, outputs), args.rounds)
        print(f"Sampler, {args.rows} rows, {name}: {step:.2f} ms a step ({step / STEP_MS:.1%} of a {STEP_MS:.0f} ms "
              f"decode step)")


if __name__ == "__main__":
    main()
