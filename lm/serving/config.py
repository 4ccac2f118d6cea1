"""The serving engine's options, each default written once: `EngineConfig`.

`lm.serving.Engine`, `mm.Pipeline(engine_options=...)` and the front ends' command-line options
(app/loading.py) all read these fields and their defaults from here.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

MAX_LEN_CAP = 32768  # a slot holds at most this many positions unless max_len says otherwise


# memory kept free for a long prompt's activations before the prefix cache takes any: a 30 s clip at
# the captioner's defaults (~12,000 tokens) on Qwen3.5-35B-A3B int4 peaks ~2.6 GiB above its weights
# (bench.big --apps)
ACTIVATION_HEADROOM = 4 << 30


def ram_bytes() -> int:
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return 16 << 30


def available_bytes() -> int:
    """Memory the kernel can still give this process (MemAvailable; the machine's RAM where unknown)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) << 10
    except (OSError, ValueError, IndexError):
        pass
    return ram_bytes()


def default_prefix_cache_bytes(available: int | None = None) -> int:
    """2 GiB, or an eighth of the machine's memory when that is less, or what the memory still
    available (`available`, default: now, after the weights are loaded) leaves beside
    ACTIVATION_HEADROOM when that is less (0: no prefix cache; the 35B-A3B in 24 GiB)."""
    ram = ram_bytes()
    left = (available_bytes() if available is None else available) - ACTIVATION_HEADROOM
    return max(0, min(2 << 30, ram // 8, left))


@dataclass(frozen=True)
class EngineConfig:
    """How the serving engine batches, budgets its steps and caches prefixes (lm/serving/__init__.py)."""

    max_batch: int = 8  # slots: sequences decoded together (8: the decode kernels' row limit)
    max_len: int | None = None  # positions of one slot (prompt + answer); None: the model's, at most MAX_LEN_CAP
    step_tokens: int = 128  # a step's token budget while streams decode (their rows, then prefill)
    prefill_chunk: int = 1024  # prefill tokens a step when no stream decodes
    prefix_cache_bytes: int | None = None  # None: default_prefix_cache_bytes(); 0: no prefix cache
    snapshot_every: int = 512  # long prompts leave a prefix-cache snapshot every this many tokens
    named_snapshots: int = 8  # at most this many of the snapshot points a caller names per prompt
    snapshot_generations: bool = True  # a finished generation leaves a snapshot (the next chat turn's prefix)

    def __post_init__(self):
        small = [f.name for f in dataclasses.fields(self) if f.name in _AT_LEAST_ONE and getattr(self, f.name) < 1]
        if small:
            raise ValueError(f"engine options {', '.join(small)} must be >= 1")
        if self.max_len is not None and self.max_len < 2:
            raise ValueError(f"engine option max_len must be >= 2, got {self.max_len}")
        if self.prefix_cache_bytes is not None and self.prefix_cache_bytes < 0:
            raise ValueError(f"engine option prefix_cache_bytes must be >= 0, got {self.prefix_cache_bytes}")

    @classmethod
    def of(cls, config: EngineConfig | None = None, **options) -> EngineConfig:
        """`config` (default: the defaults) with `options` replaced; an unknown option is a TypeError
        that names it and lists the known ones."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise TypeError(f"unknown engine option(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        return dataclasses.replace(config or cls(), **options)

    def slot_length(self, model_positions: int) -> int:
        """max_len, or the model's positions capped at MAX_LEN_CAP when it is None."""
        return self.max_len or min(model_positions, MAX_LEN_CAP)

    def cache_bytes(self) -> int:
        """The prefix cache's byte budget (the default: as the memory stands now)."""
        return default_prefix_cache_bytes() if self.prefix_cache_bytes is None else self.prefix_cache_bytes


_AT_LEAST_ONE = ("max_batch", "step_tokens", "prefill_chunk", "snapshot_every", "named_snapshots")
