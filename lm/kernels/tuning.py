"""One tuning profile per CPU class: every value the kernels are tuned by, in one place.

A profile is a frozen dataclass. `lm/kernels/build.py` writes its compile-time values as -D flags
(`Profile.defines`; the C++ headers have no defaults of their own, so a value is written once, here),
the storage policy reads `bf16_groups` (through `lm.kernels.bf16_groups`), and the Python wrappers
read `moe_pieces` and `panel_rows`. The class of this CPU comes from /proc/cpuinfo (`cpu_class`);
`QWEN35_CPU_ISA=avx2` builds the AVX2 code on an AVX-512 CPU and takes the profile's AVX2 values.
tests/lm/test_kernel_build.py compiles every profile x ISA with -fsyntax-only, so no branch rots.
Why each value is what it is: one row each in docs/kernel-decisions.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import platform
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ISAS = ("native", "avx2")  # QWEN35_CPU_ISA


@dataclass(frozen=True)
class Profile:
    """What one CPU class is tuned by. The defaults are the generic profile's."""

    cpu: str
    # formats.h: one-row products of at least this many rows of x prefetch their weights in software
    # (1: every product, 2: compute-bound products of 2-8 rows only)
    prefetch_rows: int = 2
    # formats.h: products of at most this many rows prefetch the compact formats' blocks into L2 (0: none)
    prefetch_l2_rows: int = 0
    # formats.h: the locality hint of that prefetch (2: prefetcht1, 0: prefetchnta)
    prefetch_l2_hint: int = 2
    # formats.h: how far ahead (bytes) one-row bf16 products prefetch into L2 (0: not at all)
    bf16_prefetch_l2: int = 2048
    # vec.h: one-row bf16 products in rows take block_pairs, streaming bf16_pair_rows rows at once
    bf16_pairs: bool = False
    bf16_pair_rows: int = 2
    # int8_dot.h: one-row Q8_0 / Q4_0 products in 512-bit registers (AVX-512 VNNI builds only)
    group_zmm: bool = False
    # storage (lm/formats/policy.py): bf16 matrices with their rows in groups of 8 (BF16_G8)
    bf16_groups: bool = True
    # moe_decode.cpp: parallel pieces per expert gate/up and per down
    moe_pieces: int = 1
    # decode products of at least this many rows stream panel copies of their weights (builds with
    # 16-float vectors; with 8-float vectors the 8-row panel kernel spills, so never: MAX_ROWS + 1)
    panel_rows: int = 5
    # the values the AVX2 build (QWEN35_CPU_ISA=avx2) of this class takes instead
    avx2: tuple[tuple[str, object], ...] = ()

    def for_isa(self, isa: str) -> Profile:
        """This profile for the build of `isa` ("native" or "avx2")."""
        if isa not in ISAS:
            raise ValueError(f"QWEN35_CPU_ISA must be one of {', '.join(ISAS)}, got {isa!r}")
        if isa == "native":
            return self
        return dataclasses.replace(self, group_zmm=False, avx2=(), **dict(self.avx2))

    def defines(self) -> list[str]:
        """The -D flags of a build with this profile (every compile-time value, always written)."""
        values = {
            "PREFETCH_ROWS": self.prefetch_rows,
            "PREFETCH_L2": self.prefetch_l2_rows,
            "PREFETCH_L2_HINT": self.prefetch_l2_hint,
            "BF16_PREFETCH_L2": self.bf16_prefetch_l2,
            "BF16_PAIRS": int(self.bf16_pairs),
            "BF16_PAIR_ROWS": self.bf16_pair_rows,
            "GROUP_ZMM": int(self.group_zmm),
        }
        return [f"-DQWEN35_{name}={int(value)}" for name, value in values.items()]


GENERIC = Profile("generic")
INTEL = Profile("intel", prefetch_rows=1, prefetch_l2_rows=8, bf16_prefetch_l2=8192)
ZEN3 = Profile("zen3", prefetch_l2_rows=2, prefetch_l2_hint=0, bf16_prefetch_l2=0, bf16_pairs=True,
               bf16_groups=False)  # fmt: skip
ZEN4 = Profile("zen4", bf16_pairs=True, bf16_pair_rows=1, group_zmm=True,
               avx2=(("bf16_pairs", False), ("bf16_pair_rows", 2)))  # fmt: skip
ZEN5 = Profile("zen5", prefetch_l2_rows=2)
ARM = Profile("arm")
PROFILES = {p.cpu: p for p in (GENERIC, INTEL, ZEN3, ZEN4, ZEN5, ARM)}


def read_cpuinfo() -> str:
    """The text of /proc/cpuinfo, or "" where there is none (not Linux)."""
    try:
        return Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        return ""


@functools.cache
def this_cpuinfo() -> str:
    """/proc/cpuinfo of this machine, read once."""
    return read_cpuinfo()


def cpuinfo_field(keys: tuple[str, ...], cpuinfo: str | None = None) -> str | None:
    """The value of the first line of /proc/cpuinfo (or of `cpuinfo`) whose key is in `keys`, or None."""
    for line in (this_cpuinfo() if cpuinfo is None else cpuinfo).splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() in keys:
            return value.strip()
    return None


def cpu_flags(cpuinfo: str | None = None) -> frozenset[str]:
    """The CPU's feature flags: the first `flags` (x86) or `Features` (Arm) line of /proc/cpuinfo;
    empty where there is none."""
    return frozenset((cpuinfo_field(("flags", "Features"), cpuinfo) or "").split())


def cpu_vendor(cpuinfo: str | None = None) -> str:
    """The first `vendor_id` of /proc/cpuinfo (e.g. GenuineIntel, AuthenticAMD), or "" when none."""
    return cpuinfo_field(("vendor_id",), cpuinfo) or ""


def _number(key: str, cpuinfo: str | None) -> int:
    value = cpuinfo_field((key,), cpuinfo) or ""
    return int(value) if value.isdigit() else 0


def cpu_family(cpuinfo: str | None = None) -> int:
    """The first `cpu family` of /proc/cpuinfo (AMD Zen 3 and 4: 25, Zen 5: 26), or 0 when none."""
    return _number("cpu family", cpuinfo)


def cpu_model(cpuinfo: str | None = None) -> int:
    """The first `model` of /proc/cpuinfo, or 0 when none."""
    return _number("model", cpuinfo)


def is_zen3(family: int, model: int) -> bool:
    """AMD family 25 (0x19) holds Zen 3 (models 0x00-0x0f, 0x20-0x5f) and Zen 4 (0x10-0x1f, 0x60 on)."""
    return family == 0x19 and (model < 0x10 or 0x20 <= model < 0x60)


def cpu_class(vendor: str | None = None, family: int | None = None, model: int | None = None,
              machine: str | None = None) -> str:
    """The profile name of this CPU (or of `vendor` / `family` / `model` / `machine`)."""
    vendor = cpu_vendor() if vendor is None else vendor
    family = cpu_family() if family is None else family
    model = cpu_model() if model is None else model
    machine = (platform.machine() if machine is None else machine).lower()
    if vendor == "GenuineIntel":
        return "intel"
    if vendor == "AuthenticAMD" and family == 0x19:
        return "zen3" if is_zen3(family, model) else "zen4"
    if vendor == "AuthenticAMD" and family >= 0x1A:
        return "zen5"
    if machine in ("aarch64", "arm64"):
        return "arm"
    return "generic"


def isa() -> str:
    """QWEN35_CPU_ISA: which instruction set the kernels are built for ("native" or "avx2")."""
    value = os.environ.get("QWEN35_CPU_ISA", "native").strip().lower() or "native"
    if value not in ISAS:
        raise ValueError(f"QWEN35_CPU_ISA must be one of {', '.join(ISAS)}, got {value!r}")
    return value


_override: list[Profile] = []


def current() -> Profile:
    """The profile of this CPU's class for the build QWEN35_CPU_ISA asks for (or the one `override` set)."""
    if _override:
        return _override[-1]
    return PROFILES[cpu_class()].for_isa(isa())


@contextlib.contextmanager
def override(**values: object) -> Iterator[Profile]:
    """Run with the current profile's Python-side values (moe_pieces, panel_rows, bf16_groups)
    changed; for tests and experiments. Compile-time values need a build of their own."""
    profile = dataclasses.replace(current(), **values)
    _override.append(profile)
    try:
        yield profile
    finally:
        _override.remove(profile)
