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

from bench.limits import ReadBandwidth
from bench.lm import (
    ExpertCounter,
    build,
    median,
    ours_decode,
    probed_steps,
    weight_bytes_per_step,
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=300)
    args = parser.parse_args()
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        _, model = build(Path(tmp))
    read, touched, shares = ReadBandwidth(), {}, defaultdict(list)
    ids = {batch: torch.randint(0, model.config.text.vocab_size, (batch, 32)) for batch in (1, 8)}
    for batch, prompt in ids.items():
        counter = ExpertCounter(model)  # greedy decoding repeats its routing: count on an untimed run
        ours_decode(model, prompt, 48, repeats=1)
        counter.close()
        touched[batch] = weight_bytes_per_step(model, counter.mean())
    end = time.time() + args.seconds
    while time.time() < end:
        for batch, prompt in ids.items():
            for step, before, after in probed_steps(model, prompt, 48, read):
                low, high = min(before, after), max(before, after)
                state = "upper" if low > 62e9 else "lower" if high < 55e9 else "mixed"
                shares[state, batch].append((touched[batch] / step / high, step))
    for (state, batch), steps in sorted(shares.items()):
        share = sorted(s for s, _ in steps)
        quartile = [share[int(f * (len(share) - 1))] for f in (0.25, 0.5, 0.75)]
        print(f"{state} state, batch {batch}: {len(steps)} steps, share of the limit median {quartile[1]:.0%} "
              f"(quartiles {quartile[0]:.0%}-{quartile[2]:.0%}), median step {median([t for _, t in steps]) * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
