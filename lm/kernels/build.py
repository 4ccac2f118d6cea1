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

from . import tuning
from .tuning import Profile, cpu_flags, isa  # noqa: F401 - cpu_flags and isa are this module's names too

HERE = Path(__file__).parent
SOURCES = sorted(str(p) for p in HERE.glob("*.cpp"))  # each kernel in its file; bindings.cpp names them
# -fopenmp: at::parallel_for is header code that parallelises only when OpenMP is on; the
# libgomp.so.1 torch already loaded serves it, so there is one OpenMP runtime.
CFLAGS = ["-O3", "-march=native", "-fopenmp"]
# QWEN35_CPU_ISA (tuning.isa): "native" (default), or "avx2": the flags these add to CFLAGS, and the
# CPU flags they switch off (dropped from the flags that name the build).
ISA_FLAGS = {"native": [], "avx2": ["-mno-avx512f", "-mno-avxvnni"]}
LDFLAGS = ["-fopenmp"]
BASE_NAME = "qwen35_cpu_kernels"
# A first build on 2 cores (ninja compiles the files in parallel): measured 153 s on the shared development
# VM, 265 s on a fresh 2-core machine; the estimate in the notice takes the slower.
BUILD_SECONDS_ON_2_CORES = 265


def cflags(profile: Profile | None = None, isa_name: str | None = None) -> list[str]:
    """The compiler flags of the build for `isa_name` (default: what QWEN35_CPU_ISA asks for) with
    `profile` (default: this CPU's, lm/kernels/tuning.py): the ISA's flags, then the profile's -D values."""
    isa_name = isa() if isa_name is None else isa_name
    profile = tuning.current() if profile is None else profile
    return [*CFLAGS, *ISA_FLAGS[isa_name], *profile.defines()]


def check_command(profile: Profile, isa_name: str, source: Path) -> list[str]:
    """A g++ command that compiles `source` with -fsyntax-only as the build of `profile` for
    `isa_name` would, whatever this CPU: -march=sapphirerapids (AVX-512, VNNI, AMX: every branch of
    the native builds) in place of -march=native, then the ISA's flags and the profile's values.
    tests/lm/test_kernel_build.py runs it for every profile x ISA."""
    import sysconfig

    import_builder()  # quiets torch's CUDA notice
    from torch.utils.cpp_extension import include_paths

    includes = [f"-I{p}" for p in [*include_paths(), sysconfig.get_paths()["include"], str(HERE)]]
    flags = [f for f in cflags(profile.for_isa(isa_name), isa_name) if f != "-march=native"]
    return ["g++", "-std=c++20", "-fsyntax-only", "-march=sapphirerapids", *flags, *includes, str(source)]


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
