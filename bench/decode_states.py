"""Decode share of the bandwidth limit per memory state: this VM's read bandwidth jumps between a
lower (~45 GB/s) and an upper (~78 GB/s) state within seconds. Alternating 48-token generations at
batch 1 and 8 on the `bench.lm` model, each step between two bandwidth probes, bucketed by state:
upper when both probes read above 62 GB/s, lower when both read below 55 GB/s, else mixed.

    python -m bench.decode_states [--seconds 300]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

from bench.lm import ExpertCounter, build, ours_decode, probed_steps, weight_bytes_per_step
from bench.limits import ReadBandwidth


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=300)
    args = parser.parse_args()
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        _, model = build(Path(tmp))
    read, touched, shares = ReadBandwidth(), {}, defaultdict(list)
    ids = {batch: torch.randint(0, model.config.text.vocab_size, (batch, 32)) for batch in (1, 8)}
    for batch in ids:
        counter = ExpertCounter(model)  # greedy decoding repeats its routing: count on an untimed run
        ours_decode(model, ids[batch], 48, repeats=1)
        counter.close()
        touched[batch] = weight_bytes_per_step(model, counter.mean())
    end = time.time() + args.seconds
    while time.time() < end:
        for batch in ids:
            for step, before, after in probed_steps(model, ids[batch], 48, read):
                low, high = min(before, after), max(before, after)
                state = "upper" if low > 62e9 else "lower" if high < 55e9 else "mixed"
                shares[state, batch].append((touched[batch] / step / high, step))
    for (state, batch), v in sorted(shares.items()):
        v.sort()
        q = lambda f: v[int(f * (len(v) - 1))]  # noqa: E731
        print(f"{state} state, batch {batch}: {len(v)} steps, share of the limit median {q(0.5)[0]:.0%} "
              f"(quartiles {q(0.25)[0]:.0%}-{q(0.75)[0]:.0%}), median step {sorted(s for _, s in v)[len(v) // 2] * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
