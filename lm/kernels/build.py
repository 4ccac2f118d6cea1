"""Build (once; torch caches the build) and load the C++ CPU kernels beside this file."""

from __future__ import annotations

import sys
import threading
from pathlib import Path

from torch.utils.cpp_extension import load

HERE = Path(__file__).parent
SOURCES = sorted(str(p) for p in HERE.glob("*.cpp"))  # each kernel in its file; bindings.cpp names them


def load_kernels():
    """The compiled module; raises if no C++ compiler / ninja is available or the build fails."""
    # -fopenmp: at::parallel_for is header code that parallelises only when OpenMP is on; the
    # libgomp.so.1 torch already loaded serves it, so there is one OpenMP runtime.
    # a cached build loads in well under a second; say so when a real build is running
    notice = threading.Timer(3.0, lambda: print("[qwen35] building the C++ CPU kernels (first use: about a minute, "
                                                "then cached)...", file=sys.stderr, flush=True))
    notice.start()
    try:
        return load(
            name="qwen35_cpu_kernels",
            sources=SOURCES,
            extra_include_paths=[str(HERE)],
            extra_cflags=["-O3", "-march=native", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
        )
    finally:
        notice.cancel()
