"""Give large freed buffers back to the OS when the model fills most of the memory (glibc).

glibc serves an allocation from its heap unless it is above the mmap threshold, and it raises that
threshold (up to 32 MiB) each time a large mmap'd block is freed. So after the first prefill most
activation buffers come from the heap, and the heap keeps what they leave: fragments it cannot hand
back. On Qwen3.5-35B-A3B in int4 that is ~1 GiB over a 1,000-token prefill (peak RSS 23.0 GiB
instead of 22.0). A fixed threshold of 4 MiB sends every large buffer to mmap, returned to the OS as
it is freed, at the cost of fresh page faults (a prefill of a 4-layer slice of that model took ~5%
longer). `release_large_buffers` does this only when the weights take over half of the memory.
"""

from __future__ import annotations

import ctypes
import os
import sys

M_MMAP_THRESHOLD = -3
THRESHOLD = 4 << 20
_set = False


def physical_memory() -> int:
    """Bytes of RAM on this machine (0 where unknown)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def release_large_buffers(model_bytes: int) -> bool:
    """Fix glibc's mmap threshold at 4 MiB when `model_bytes` exceed half the RAM (once per process,
    said on stderr); returns whether it is set. Left alone where MALLOC_MMAP_THRESHOLD_ is in the
    environment (the user's own choice) or the C library has no mallopt."""
    global _set
    ram = physical_memory()
    if _set or not ram or model_bytes <= ram // 2 or "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return _set
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    if mallopt(M_MMAP_THRESHOLD, THRESHOLD) != 1:
        return False
    _set = True
    print(f"[qwen35] the weights take {model_bytes / 2**30:.1f} of {ram / 2**30:.1f} GiB of RAM: buffers over "
          f"{THRESHOLD >> 20} MiB go back to the OS when freed (glibc mmap threshold; a few % of prefill speed; "
          "set MALLOC_MMAP_THRESHOLD_ to choose yourself)", file=sys.stderr)
    return True
