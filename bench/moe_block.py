"""One MoE decode block alone (`kernels.moe_decode`), in cache and from memory.

    python -m bench.moe_block [--format int4] [--layers 16] [--rows 1]

Random weights of bench/lm.py's MoE shape (64 experts, top 8, hidden 1024, expert width 256, one
shared expert; router bf16) for `--layers` layers, in one huge-page buffer as a loaded model's are.
Times blocks of the same layer (its weights stay in the caches: the block's compute and fixed costs)
and of the layers in turn (from memory), with the read bandwidth probed after each pair; prints the
median time per block and the bytes one block reads per second (the selected experts, the shared
expert and the router).
"""

from __future__ import annotations

import argparse
import time

import torch

from bench.limits import ReadBandwidth
from bench.products import in_huge_pages
from lm import kernels
from lm.formats import BF16, FORMATS, policy

H, I, E, TOP_K = 1024, 256, 64, 8


def layer(fmt, g: torch.Generator) -> list[torch.Tensor]:
    """router, gate_up [E, 2I, .], down [E, H, .], shared gate/up/down, shared-expert gate."""
    def w(*shape):
        return torch.randn(*shape, generator=g) * 0.02

    def stored(n, k):
        return fmt.quantize(w(n, k))

    return [w(E, H).bfloat16(), stored(E * 2 * I, H).view(E, 2 * I, -1), stored(E * H, I).view(E, H, -1),
            stored(I, H), stored(I, H), stored(H, I), w(H)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--format", default="int4", choices=sorted(FORMATS))
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--rows", type=int, default=1, help="tokens (1-8)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    k = kernels._kernels()
    if k is None:
        raise SystemExit("the CPU kernels are off or not built (QWEN35_CPU_KERNELS); nothing to measure")
    fmt, g = policy.storage(args.format, kernels.bf16_groups()), torch.Generator().manual_seed(0)
    params = in_huge_pages([t.contiguous() for _ in range(args.layers) for t in layer(fmt, g)])
    layers = [params[i * 7 : (i + 1) * 7] for i in range(args.layers)]
    x = torch.randn(args.rows, H, generator=g)
    per_weight = layers[0][3].numel() * layers[0][3].element_size() / (I * H)  # storage bytes per weight
    experts = min(E, TOP_K * args.rows)  # at most; one token reads exactly TOP_K
    nbytes = (experts + 1) * 3 * I * H * per_weight + E * H * 2
    probe = ReadBandwidth(1.0)
    print(f"{args.format} MoE block, {args.rows} row(s), {args.layers} layers; {nbytes / 1e6:.2f} MB a block "
          f"(for {experts} experts); {torch.get_num_threads()} threads")
    for _ in range(args.repeats):
        for where in ("in cache", "from memory"):
            times = []
            for _ in range(30):
                start = time.perf_counter()
                for i in range(args.layers):
                    r, gu, dn, sg, su, sd, seg = layers[0 if where == "in cache" else i]
                    k.moe_decode(x, (r, BF16.code), (gu, fmt.code), (dn, fmt.code), TOP_K, (sg, fmt.code),
                                 (su, fmt.code), (sd, fmt.code), seg, kernels.moe_pieces())
                times.append((time.perf_counter() - start) / args.layers)
            t = sorted(times)[len(times) // 2]
            print(f"  {where:11s}: {t * 1e6:6.1f} us a block, {nbytes / t / 1e9:5.1f} GB/s", flush=True)
        print(f"  read bandwidth probed: {probe(3) / 1e9:.1f} GB/s")


if __name__ == "__main__":
    main()
