"""Ask Linux for transparent huge pages behind large weight tensors.

Decoding streams every weight once per token. With 4 KiB pages the CPU's hardware prefetchers stop
at each page boundary and the TLB misses often; 2 MiB pages keep the stream going. Linux's usual
THP mode is "madvise": only memory marked with MADV_HUGEPAGE gets huge pages. This marks the
storage of the given tensors; it must run before their pages are first written. A no-op on other
systems or when the kernel refuses.
"""

from __future__ import annotations

import ctypes
import sys

MADV_HUGEPAGE = 14
HUGE_PAGE = 2 << 20


def advise_huge_pages(tensors) -> int:
    """Mark the whole 2 MiB pages inside each CPU tensor's memory; returns the bytes marked."""
    if not sys.platform.startswith("linux"):
        return 0
    try:
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return 0
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    marked = 0
    for t in tensors:
        if t.device.type != "cpu" or t.numel() * t.element_size() < 2 * HUGE_PAGE:
            continue
        start = t.data_ptr()
        end = start + t.numel() * t.element_size()
        first = (start + HUGE_PAGE - 1) // HUGE_PAGE * HUGE_PAGE
        last = end // HUGE_PAGE * HUGE_PAGE
        if last > first and madvise(first, last - first, MADV_HUGEPAGE) == 0:
            marked += last - first
    return marked
