"""The decode product kernels alone, per weight format: their rate and share of the read bandwidth.

    python -m bench.products [--formats fp32,bf16,int8,int4] [--rows 1] [--repeats 3]

Times one batch's products through a list of decode-shaped weights (12 x [4096 x 1024], [1024 x
4096], [2048 x 1024], [1024 x 2048]: 0.15 G weights, far larger than the caches, in huge pages as
a loaded model's are), each as one call of the kernel a decode step uses, and prints per format
the bytes read per second, their share of the read bandwidth probed right after, and the weights
per second. A format whose kernel stays well under the probe at one row is bound by the CPU's
arithmetic, not by memory: that rate is the ceiling of a decode step in that format (the
int8/int4 products of 2 AVX2 cores reach ~35-41 G weights/s, ~60-85% of a ~35 GB/s probe and less
of a faster one), whatever the rest of the step costs.
"""

from __future__ import annotations

import argparse

import torch

from bench.limits import ReadBandwidth, best_time
from lm import kernels
from lm.formats import FORMATS
from lm.hugepages import advise_huge_pages

SHAPES = [(4096, 1024), (1024, 4096), (2048, 1024), (1024, 2048)] * 12


def weights_in(fmt, shapes) -> list[torch.Tensor]:
    """Random weights of `shapes` in `fmt`'s storage, each in memory marked for huge pages."""
    g = torch.Generator().manual_seed(0)
    out = []
    for n, k in shapes:
        w = fmt.quantize(torch.randn(n, k, generator=g) * 0.02).contiguous()
        copy = torch.empty_like(w)
        advise_huge_pages([copy])  # before the first write
        out.append(copy.copy_(w))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--formats", default="fp32,bf16,int8,int4")
    parser.add_argument("--rows", type=int, default=1, help="rows of x (the decode batch), 1-8")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    k = kernels._kernels()
    if k is None:
        raise SystemExit("the CPU kernels are off or not built (QWEN35_CPU_KERNELS); nothing to measure")
    probe = ReadBandwidth(1.0)
    weights_count = sum(n * kk for n, kk in SHAPES)
    print(f"{len(SHAPES)} products, {weights_count / 1e9:.2f} G weights, {args.rows} row(s) of x; "
          f"{torch.get_num_threads()} threads; int8 activations {'on' if k.INT8_DOT else 'not built'}")
    for name in args.formats.split(","):
        fmt = FORMATS[name]
        ws = weights_in(fmt, SHAPES)
        nbytes = sum(w.numel() * w.element_size() for w in ws)
        xs = {kk: torch.randn(args.rows, kk) for _, kk in SHAPES}

        def products():
            for (_, kk), w in zip(SHAPES, ws):
                k.small_m_linear(xs[kk], w, kernels._NO_PANELS)

        for _ in range(args.repeats):
            seconds = best_time(products, repeats=5)
            bandwidth = probe(5)
            print(f"{name:>5}: {nbytes / 2**20:5.0f} MiB in {seconds * 1e3:5.1f} ms: {nbytes / seconds / 1e9:5.1f} GB/s "
                  f"= {nbytes / seconds / bandwidth:4.0%} of the {bandwidth / 1e9:.1f} GB/s probed; "
                  f"{weights_count / seconds / 1e9:5.1f} G weights/s", flush=True)
        del ws


if __name__ == "__main__":
    main()
