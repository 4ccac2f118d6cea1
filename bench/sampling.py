"""What drawing one sampled token costs: lm.sampling.draw beside torch.multinomial, on the real
vocabulary, and a whole Sampler call for rows sampled from the full vocabulary (temperature 1, no
top-k / top-p / min-p: the OpenAI API's defaults).

    python -m bench.sampling [--vocab 248320] [--rows 8] [--rounds 50]

Medians over `--rounds` calls, each on fresh softmax probabilities of random logits. A sampled row's
draw runs once per decode step, so beside the Sampler's figure: its share of a 200 ms step
(Qwen3.5-35B-A3B int4 at batch 8 on 2 cores: 37-42 tok/s in docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from lm import Sampler, SamplingParams
from lm.sampling import draw

STEP_MS = 200.0


def median_ms(fn, rounds: int) -> float:
    fn()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


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
    logits = torch.randn(args.rows, args.vocab, generator=g)
    sampler = Sampler([SamplingParams(temperature=1.0, seed=i) for i in range(args.rows)], [[]] * args.rows)
    rows, outputs = list(range(args.rows)), [[] for _ in range(args.rows)]
    step = median_ms(lambda: sampler(logits, rows, outputs), args.rounds)
    print(f"Sampler, {args.rows} rows at temperature 1: {step:.2f} ms a step "
          f"({step / STEP_MS:.0%} of a {STEP_MS:.0f} ms decode step); with torch.multinomial it would add "
          f"{args.rows * (theirs - ours):.1f} ms")


if __name__ == "__main__":
    main()
