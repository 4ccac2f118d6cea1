"""The decode product kernels alone, per weight format: their rate and share of the read bandwidth.

    python -m bench.products [--formats fp32,bf16,int8,int4,q4_k,q5_k,q6_k] [--rows 1] [--repeats 3]
                             [--threads N] [--in-cache]

Times one batch's products through a list of decode-shaped weights (12 x [4096 x 1024], [1024 x
4096], [2048 x 1024], [1024 x 2048]: 0.15 G weights, repeated with new values until the format's
bytes reach 512 MiB and 4x the last-level cache; in huge pages as a loaded model's are), each as one
call of the kernel a decode step uses, and prints per format the bytes read per second, their
share of the read bandwidth probed right after, and the weights per second. A format whose kernel stays well under the probe at one row is bound by the CPU's
arithmetic, not by memory: that rate is the ceiling of a decode step in that format (the
int8/int4 products of 2 AVX2 cores reach ~35-41 G weights/s, ~60-85% of a ~35 GB/s probe and less
of a faster one), whatever the rest of the step costs. `--in-cache` runs one [4096 x 1024] weight
48 times instead (at most 8 MiB: it stays in the last-level cache), the arithmetic rate alone;
with `--threads 1`, per core. The K-quants (q4_k, q5_k, q6_k: GGUF files' formats) are random
super-blocks with small fp16 scales (no quantizer of ours makes them).
"""

from __future__ import annotations

import argparse

import torch

from bench.limits import ReadBandwidth, best_time, last_level_cache_bytes
from lm import kernels
from lm.formats import KQUANTS, policy
from lm.hugepages import gather_into_huge_pages

SHAPES = [(4096, 1024), (1024, 4096), (2048, 1024), (1024, 2048)] * 12
# Each format streams at least this many bytes a pass, and 4x the last-level cache. The L3 does not
# evict in LRU order, so a list only a few times its size partly stays there from pass to pass:
# 81 MiB of Q4_0 (the list above once) read at up to 131% of the probe on a 2-core Zen 4 with a
# 32 MiB L3 (fp32's 576 MiB at 90-101%; 567 MiB of Q4_0 at 92-99%).
MIN_BYTES = 512 << 20


def streamed_shapes(fmt) -> list[tuple[int, int]]:
    """SHAPES, repeated until the weights take MIN_BYTES and 4x the last-level cache in `fmt`'s storage."""
    once = sum(n * k for n, k in SHAPES) * fmt.bits_per_weight / 8
    return SHAPES * int(-(-max(MIN_BYTES, 4 * last_level_cache_bytes()) // once))


def in_huge_pages(tensors) -> list[torch.Tensor]:
    """Copies of `tensors` in one buffer marked for huge pages, as a loaded model's weights are
    (lm.hugepages.gather_into_huge_pages): each weight in an allocation of its own had its ends in
    small pages, and 4 MiB products streamed ~30 GB/s there against 41-44 from one huge-page buffer
    (2-core Zen 4, fast memory state)."""
    out = [torch.empty_like(t) for t in tensors]
    gather_into_huge_pages(out, low=0)  # moves the unwritten tensors into the buffer
    for o, t in zip(out, tensors):
        o.copy_(t)
    return out


def weights_in(fmt, shapes) -> list[torch.Tensor]:
    """Random weights of `shapes` in `fmt`'s storage, in one huge-page buffer (in_huge_pages)."""
    g = torch.Generator().manual_seed(0)
    if fmt in KQUANTS.values():  # a K-quant: random bytes, the fp16 scales (byte 0 on; Q6_K's at 208) made small
        def random_rows(n, k):
            raw = torch.randint(0, 256, (n * k // 256, fmt.block_bytes), dtype=torch.uint8, generator=g)
            scales = torch.full((raw.shape[0], 1), 1e-3, dtype=torch.float16).view(torch.uint8)
            for at in ((208,) if fmt.name == "q6_k" else (0, 2)):
                raw[:, at : at + 2] = scales
            return raw.view(n, -1)

        return in_huge_pages([random_rows(n, k) for n, k in shapes])
    return in_huge_pages([fmt.quantize(torch.randn(n, k, generator=g) * 0.02).contiguous() for n, k in shapes])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--formats", default="fp32,bf16,int8,int4")
    parser.add_argument("--rows", type=int, default=1, help="rows of x (the decode batch), 1-8")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--in-cache", action="store_true", help="one cache-resident weight: compute alone")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    k = kernels._kernels()
    if k is None:
        raise SystemExit("the CPU kernels are off or not built (QWEN35_CPU_KERNELS); nothing to measure")
    probe = None if args.in_cache else ReadBandwidth(1.0)
    print(f"{args.rows} row(s) of x; {torch.get_num_threads()} threads; "
          f"int8 activations {'on' if k.INT8_DOT else 'not built'}")
    for name in args.formats.split(","):
        kquant = {f.name: f for f in KQUANTS.values()}.get(name)
        fmt = kquant or policy.storage(name, kernels.bf16_groups())  # bf16: in groups of 8 rows where the policy would
        shapes = [(4096, 1024)] * 48 if args.in_cache else streamed_shapes(fmt)
        weights_count = sum(n * kk for n, kk in shapes)
        ws = weights_in(fmt, shapes[:1]) * len(shapes) if args.in_cache else weights_in(fmt, shapes)
        nbytes = sum(w.numel() * w.element_size() for w in ws)
        xs = {kk: torch.randn(args.rows, kk) for _, kk in shapes}

        def products():
            for (_, kk), w in zip(shapes, ws):
                k.small_m_linear(xs[kk], (w, fmt.code), kernels._NO_PANELS)

        for _ in range(args.repeats):
            seconds = best_time(products, repeats=5)
            rate = f"{weights_count / seconds / 1e9:5.1f} G weights/s"
            if args.in_cache:  # nothing streams from memory: no share of the bandwidth to give
                print(f"{name:>5}: {seconds * 1e3:5.1f} ms: {rate} (cache-resident)", flush=True)
                continue
            bandwidth = probe(5)
            print(f"{name:>5}: {nbytes / 2**20:5.0f} MiB in {seconds * 1e3:5.1f} ms: {nbytes / seconds / 1e9:5.1f} GB/s "
                  f"= {nbytes / seconds / bandwidth:4.0%} of the {bandwidth / 1e9:.1f} GB/s probed; {rate}", flush=True)
        del ws


if __name__ == "__main__":
    main()
