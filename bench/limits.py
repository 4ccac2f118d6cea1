"""The machine's physical limits, measured in-process: memory read bandwidth and float32 matmul FLOP/s."""

from __future__ import annotations

import time

import torch

from lm.hugepages import advise_huge_pages


def run_times(fn, repeats: int = 5, warmup: int = 1) -> list[float]:
    """Wall times of `repeats` runs of `fn()` after `warmup` untimed ones, in seconds."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def best_time(fn, repeats: int = 5, warmup: int = 1) -> float:
    """Fastest wall time of `fn()` over `repeats` runs, in seconds."""
    return min(run_times(fn, repeats, warmup))


class ReadBandwidth:
    """Bytes/s of a streaming read: a sum over random data far larger than the caches (random, so
    that no page deduplication by the host can make the buffer smaller than it looks), in memory
    backed by huge pages where the system gives them, as the loaded model's weights are (4 KiB pages
    read up to ~15% slower here: measuring with them would understate the limit). The buffer is
    made once, so that a probe takes ~0.1 s and can run between the repeats of a measurement."""

    def __init__(self, gib: float = 1.0):
        self.x = torch.empty(int(gib * 2**30) // 4)
        advise_huge_pages([self.x])  # before the first write, which is when the pages are chosen
        self.x.normal_()

    def __call__(self, repeats: int = 7) -> float:
        return self.x.numel() * 4 / best_time(lambda: self.x.sum(), repeats=repeats)


def last_level_cache_bytes() -> int:
    """The size of the largest CPU cache Linux reports for CPU 0 (0 where unknown)."""
    from pathlib import Path

    sizes = [0]
    for path in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        try:
            text = path.read_text().strip()
        except OSError:
            continue
        unit = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        if text.rstrip("KMG").isdigit():
            sizes.append(int(text.rstrip("KMG")) * unit)
    return max(sizes)


class CacheEvictor:
    """A call reads a buffer of 4x the last-level cache (at least 64 MiB) so that what runs next
    reads its data from memory, as each part of a decode step does: ~300 MB and more of other
    weights go through the caches between one step's read of a tensor and the next's. (Zen's L3 does
    not evict in LRU order: a part of a 32 MiB L3's lines can outlive one pass over 2-3x its size.)"""

    def __init__(self):
        self.x = torch.ones(max(64 << 20, 4 * last_level_cache_bytes()) // 4)

    def __call__(self) -> None:
        self.x.sum()


def matmul_flops(n: int = 2048) -> float:
    """float32 FLOP/s of a large square matmul."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    return 2 * n**3 / best_time(lambda: a @ b)
