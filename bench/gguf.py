"""A GGUF file's speed under several `--weights` specs: decode and prefill, in turns.

    python -m bench.gguf FILE.gguf [--weights auto,int4] [--batches 1,8] [--new 32] [--rounds 3]

Loads the file once per spec (`auto`: each tensor as the file holds it, K-quants included; `int4`:
every block matrix converted to Q4_0), prints the formats its matrices got, then decode tok/s at each
batch with the share of the bandwidth limit (bench.formats.decode: the specs take turns, so that all
see the same memory states) and pp512. Beside llama.cpp: `llama-bench -m FILE.gguf -p 512 -n 64 -t 2`
on the same file and machine.
"""

from __future__ import annotations

import argparse
import collections
from pathlib import Path

import mm
from bench.formats import decode, prefill
from bench.limits import ReadBandwidth
from lm.formats import param_format


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("file", type=Path)
    parser.add_argument("--weights", default="auto,int4", help="comma-separated weights= specs")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--new", type=int, default=32, help="new tokens a decode run")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    models = {spec: mm.load_model(args.file, weights=spec) for spec in args.weights.split(",")}
    for spec, model in models.items():
        kinds = collections.Counter(param_format(model.lm, n).name for n, _ in model.lm.named_parameters())
        print(f"weights={spec}: " + ", ".join(f"{k} {n}" for k, n in sorted(kinds.items())), flush=True)
    read = ReadBandwidth(1.0)
    for batch in (int(b) for b in args.batches.split(",")):
        for spec, (tps, share, gb, probe) in decode(models, batch, args.new, read, rounds=args.rounds).items():
            print(f"batch {batch} weights={spec:6s} {tps:6.1f} tok/s, {share:4.0%} of the limit "
                  f"({gb:.2f} GB a step; probe {probe / 1e9:.0f} GB/s)", flush=True)
    for spec, tps in prefill(models, 512).items():
        print(f"pp512 weights={spec:6s} {tps:6.1f} tok/s", flush=True)


if __name__ == "__main__":
    main()
