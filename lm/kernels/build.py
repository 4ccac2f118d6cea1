"""Build (once per CPU instruction set and source version) and load the C++ CPU kernels beside this file.

The kernels are compiled with `-march=native`, so a build is only valid on CPUs with the same
instruction set. torch's extension cache keys a build by its name and sources but not by the CPU:
a home directory shared by nodes with and without AVX-512 (a SLURM cluster) would load an AVX-512
build on an AVX2 node and die with an illegal instruction. So the extension's name carries both:

    qwen35_cpu_kernels_<isa label>_<hash of the CPU's feature flags>_<hash of sources and build>

and each name has its own build directory `<root>/<name>/`, root = $TORCH_EXTENSIONS_DIR, else
torch's default (~/.cache/torch_extensions). A finished build (`<name>.so`) is imported directly,
without a compiler; the name depends only on file contents, never on where the checkout lives,
so a fresh clone finds the build of an earlier one. Nothing else is cached: a different CPU,
source file, torch or Python version means a new name and one new build.

QWEN35_CPU_ISA=avx2 builds and loads the kernels without AVX-512 and AVX-VNNI (`-mno-avx512f
-mno-avxvnni`) on a CPU that has them: the code an AVX2-only CPU (Zen 2/3, Haswell to Skylake
client) runs, so that both builds can be measured on one machine. Its name carries "avx2" and the
extra flags, so it never replaces the native build.

`python -m lm.kernels.build` builds them now (the install step runs it); front ends call
`prebuild()` before they serve, so that no request waits minutes for a build.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import logging
import math
import os
import platform
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from types import ModuleType

import torch

HERE = Path(__file__).parent
SOURCES = sorted(str(p) for p in HERE.glob("*.cpp"))  # each kernel in its file; bindings.cpp names them
# -fopenmp: at::parallel_for is header code that parallelises only when OpenMP is on; the
# libgomp.so.1 torch already loaded serves it, so there is one OpenMP runtime.
CFLAGS = ["-O3", "-march=native", "-fopenmp"]
# QWEN35_CPU_ISA: "native" (default), or "avx2": the flags these add to CFLAGS, and the CPU flags
# they switch off (dropped from the flags that name the build).
ISA_FLAGS = {"native": [], "avx2": ["-mno-avx512f", "-mno-avxvnni"]}
LDFLAGS = ["-fopenmp"]
BASE_NAME = "qwen35_cpu_kernels"
# A first build on 2 cores (ninja compiles the files in parallel): measured 153 s on the shared development
# VM, 265 s on a fresh 2-core machine; the estimate in the notice takes the slower.
BUILD_SECONDS_ON_2_CORES = 265


def read_cpuinfo() -> str:
    """The text of /proc/cpuinfo, or "" where there is none (not Linux)."""
    try:
        return Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        return ""


def cpuinfo_field(keys: tuple[str, ...], cpuinfo: str | None = None) -> str | None:
    """The value of the first line of /proc/cpuinfo (or of `cpuinfo`) whose key is in `keys`, or None."""
    if cpuinfo is None:
        cpuinfo = read_cpuinfo()
    for line in cpuinfo.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() in keys:
            return value.strip()
    return None


def cpu_flags(cpuinfo: str | None = None) -> frozenset[str]:
    """The CPU's feature flags: the first `flags` (x86) or `Features` (Arm) line of /proc/cpuinfo.

    Empty when there is no such line (not Linux); the cache is then keyed by `platform.processor()`.
    """
    return frozenset((cpuinfo_field(("flags", "Features"), cpuinfo) or "").split())


def isa() -> str:
    """QWEN35_CPU_ISA: which instruction set the kernels are built for ("native" or "avx2")."""
    value = os.environ.get("QWEN35_CPU_ISA", "native").strip().lower() or "native"
    if value not in ISA_FLAGS:
        raise ValueError(f"QWEN35_CPU_ISA must be one of {', '.join(ISA_FLAGS)}, got {value!r}")
    return value


def cpu_vendor(cpuinfo: str | None = None) -> str:
    """The first `vendor_id` of /proc/cpuinfo (e.g. GenuineIntel, AuthenticAMD), or "" when none."""
    return cpuinfo_field(("vendor_id",), cpuinfo) or ""


def cpu_family(cpuinfo: str | None = None) -> int:
    """The first `cpu family` of /proc/cpuinfo (AMD Zen 4: 25, Zen 5: 26), or 0 when none."""
    value = cpuinfo_field(("cpu family",), cpuinfo) or ""
    return int(value) if value.isdigit() else 0


def cpu_model(cpuinfo: str | None = None) -> int:
    """The first `model` of /proc/cpuinfo (AMD family 25: Zen 3 below 0x10 and 0x20-0x5f, Zen 4 the
    rest), or 0 when none."""
    value = cpuinfo_field(("model",), cpuinfo) or ""
    return int(value) if value.isdigit() else 0


def is_zen3(family: int, model: int) -> bool:
    """AMD family 25 (0x19) holds Zen 3 (models 0x00-0x0f, 0x20-0x5f) and Zen 4 (0x10-0x1f, 0x60 on)."""
    return family == 0x19 and (model < 0x10 or 0x20 <= model < 0x60)


def is_zen4(family: int, model: int) -> bool:
    """AMD family 25 (0x19) models 0x10-0x1f and 0x60 on: Zen 4 (see is_zen3)."""
    return family == 0x19 and not is_zen3(family, model)


def on_zen3(cpuinfo: str | None = None) -> bool:
    """Whether this CPU (or `cpuinfo`'s) is an AMD Zen 3, which has rules of its own: `cflags` and
    lm.formats.policy.bf16_groups (which asks at every load: /proc/cpuinfo is read once for this)."""
    if cpuinfo is None:
        cpuinfo = _this_cpuinfo()
    return cpu_vendor(cpuinfo) == "AuthenticAMD" and is_zen3(cpu_family(cpuinfo), cpu_model(cpuinfo))


@functools.cache
def _this_cpuinfo() -> str:
    return read_cpuinfo()


def cflags(vendor: str | None = None, family: int | None = None, model: int | None = None) -> list[str]:
    """The compiler flags of the build QWEN35_CPU_ISA asks for, on this CPU (or `vendor`'s / `family`'s
    / `model`'s): Intel CPUs prefetch one-row products in software, others do not; Intel, AMD Zen 3 and
    Zen 5 on (family 0x1A+) prefetch the compact formats' memory-bound products into L2 (Zen 3 with
    prefetchnta, and not bf16's), Zen 3 streams one-row bf16 products two rows at a time as pairs, and
    Zen 4's AVX-512 build takes one-row Q8_0 / Q4_0 products in 512-bit registers and one-row bf16
    products as pairs, one row at a time (measured: formats.h,
    prefetch_ahead and prefetch_block; vec.h, block_pairs; int8_dot.h, dot_group_q4_0_zmm)."""
    vendor = cpu_vendor() if vendor is None else vendor
    family = cpu_family() if family is None else family
    model = cpu_model() if model is None else model
    prefetch = ["-DQWEN35_PREFETCH_ROWS=1"] if vendor == "GenuineIntel" else []
    zen3 = vendor == "AuthenticAMD" and is_zen3(family, model)
    if zen3 or (vendor == "AuthenticAMD" and family >= 0x1A):  # Zen 3, Zen 5 on: the compact formats' L2 prefetch
        prefetch.append("-DQWEN35_PREFETCH_L2=2")
    if zen3:  # that prefetch as prefetchnta, bf16 not prefetched, one-row bf16 products two rows at a time
        prefetch += ["-DQWEN35_PREFETCH_L2_HINT=0", "-DQWEN35_BF16_PREFETCH_L2=0", "-DQWEN35_BF16_PAIRS=1"]
    if vendor == "AuthenticAMD" and is_zen4(family, model) and isa() == "native":
        # one-row Q8_0 / Q4_0 in zmm; one-row bf16 products as pairs, one row at a time
        prefetch += ["-DQWEN35_GROUP_ZMM=1", "-DQWEN35_BF16_PAIRS=1", "-DQWEN35_BF16_PAIR_ROWS=1"]
    return [*CFLAGS, *ISA_FLAGS[isa()], *prefetch]


def build_flags(flags: Iterable[str]) -> frozenset[str]:
    """The CPU flags the build uses: `flags` less AVX-512 and AVX-VNNI under QWEN35_CPU_ISA=avx2."""
    flags = frozenset(flags)
    if isa() == "avx2":
        flags = frozenset(f for f in flags if not f.startswith("avx512") and f != "avx_vnni")
    return flags


def isa_tag(flags: Iterable[str], machine: str | None = None) -> str:
    """A readable label plus a hash of every feature flag, e.g. "avx2_1a2b3c4d".

    Every flag counts, not just the vector extensions: `-march=native` may use any of them, and a
    flag set that differs for another reason costs one extra build, never an illegal instruction.
    """
    flags = frozenset(flags)
    machine = machine or platform.machine()
    if "avx512f" in flags:
        label = "avx512"
    elif "avx2" in flags:
        label = "avx2"
    elif "sve" in flags:
        label = "sve"
    else:
        label = "".join(c if c.isalnum() else "_" for c in machine.lower()) or "cpu"
    described = " ".join(sorted(flags)) if flags else f"processor={platform.processor()}"
    digest = hashlib.sha256(f"{machine}\n{described}".encode()).hexdigest()[:8]
    return f"{label}_{digest}"


def source_tag() -> str:
    """A hash of what goes into a build besides the CPU: source and header contents, flags, torch, Python."""
    digest = hashlib.sha256()
    for path in sorted([*HERE.glob("*.cpp"), *HERE.glob("*.h")]):
        digest.update(f"{path.name}\n".encode() + path.read_bytes() + b"\n")
    digest.update(" ".join([*cflags(), "|", *LDFLAGS, torch.__version__, sys.implementation.cache_tag]).encode())
    return digest.hexdigest()[:8]


def extension_name(flags: Iterable[str] | None = None) -> str:
    """The extension's module name for this CPU (or for `flags`) and the current sources."""
    return f"{BASE_NAME}_{isa_tag(build_flags(cpu_flags() if flags is None else flags))}_{source_tag()}"


def build_root() -> Path:
    """$TORCH_EXTENSIONS_DIR, else torch's default extension folder (~/.cache/torch_extensions)."""
    if os.environ.get("TORCH_EXTENSIONS_DIR"):
        return Path(os.environ["TORCH_EXTENSIONS_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "torch_extensions"


def build_directory(name: str) -> Path:
    return build_root() / name


def cached_library(name: str) -> Path | None:
    """The finished build of extension `name`, or None when there is none."""
    library = build_directory(name) / f"{name}.so"
    return library if library.is_file() else None


def build_minutes(cores: int | None = None) -> int:
    """Rough minutes of a first build on `cores` cores (from the measured 2-core time)."""
    cores = max(1, min(cores or os.cpu_count() or 1, len(SOURCES)))
    return max(1, math.ceil(BUILD_SECONDS_ON_2_CORES * 2 / cores / 60))


def load_kernels() -> ModuleType:
    """The compiled module: a cached build for this CPU and these sources, else a new build
    (announced on stderr, with its time; also when the cached library does not load). Raises if no C++ compiler / ninja is available or the
    build fails (the error carries the compiler's output)."""
    name = extension_name()
    library = cached_library(name)
    if library is not None:
        try:
            return _import(name, library)
        except ImportError as error:  # e.g. a build killed while linking
            print(f"[qwen35] the cached CPU kernels {library} do not load ({error}); building them again",
                  file=sys.stderr, flush=True)  # fmt: skip
            library.unlink()
    directory = build_directory(name)
    print(f"[qwen35] building CPU kernels (one time, ~{build_minutes()} min on {os.cpu_count()} cores) in "
          f"{directory} ...", file=sys.stderr, flush=True)  # fmt: skip
    start = time.perf_counter()
    module = _build(name, directory)
    print(f"[qwen35] CPU kernels built in {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)
    return module


def _import(name: str, library: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, library)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import the CPU kernels from {library}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class _NoCudaNotice(logging.Filter):
    """Drops torch's "No CUDA runtime is found, using CUDA_HOME=..." warning: it is printed on
    importing the extension builder with a CUDA build of torch on a machine without a GPU, and
    says nothing about these kernels, which are CPU code built without CUDA."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("No CUDA runtime is found")


def import_builder() -> Callable[..., ModuleType]:
    """torch's `cpp_extension.load`, imported without its "No CUDA runtime is found" warning."""
    logging.getLogger("torch.utils.cpp_extension").addFilter(_NoCudaNotice())
    from torch.utils.cpp_extension import load

    return load


def _build(name: str, directory: Path) -> ModuleType:
    load = import_builder()
    directory.mkdir(parents=True, exist_ok=True)
    return load(name=name, sources=SOURCES, extra_include_paths=[str(HERE)], extra_cflags=cflags(),
                extra_ldflags=LDFLAGS, build_directory=str(directory))  # fmt: skip


def prebuild() -> bool:
    """Build (first time, announced) or load the CPU kernels now, before a front end serves.

    Honours QWEN35_CPU_KERNELS (see lm.kernels): "0" builds nothing; "1" raises RuntimeError when the
    build fails; by default a failure is reported on stderr now, with the compiler's output, and
    the reference paths are used. Returns whether the kernels are in use. Call it once at start-up.
    """
    from . import _kernels, mode

    if mode() == "0":
        return False
    return _kernels() is not None


def main() -> int:
    """`python -m lm.kernels.build`: build now; exit status 1 (with the reason) when the build fails."""
    from . import mode

    if mode() == "0":
        print("[qwen35] QWEN35_CPU_KERNELS=0: the CPU kernels are off, nothing to build", file=sys.stderr)
        return 0
    name = extension_name()
    try:
        load_kernels()
    except Exception as error:  # noqa: BLE001 - report any build failure as the reason
        print(f"error: the CPU kernels did not build: {error}\nInstall a C++ compiler (g++) and ninja, or set "
              "QWEN35_CPU_KERNELS=0 to run the 2-3x slower reference paths.", file=sys.stderr)  # fmt: skip
        return 1
    built_for = "" if isa() == "native" else f" (QWEN35_CPU_ISA={isa()})"
    print(f"[qwen35] CPU kernels ready{built_for}: {cached_library(name) or build_directory(name)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
