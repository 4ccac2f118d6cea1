"""lm/malloc.py: with the fixed threshold, freed activation-sized buffers go back to the OS."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.subprocess

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """
import sys, torch
from lm import malloc

def anon():
    return int(open("/proc/self/status").read().split("RssAnon:")[1].split()[0]) << 10

if sys.argv[1] == "on":
    assert malloc.release_large_buffers(malloc.physical_memory())  # "weights" as large as the RAM
    assert malloc.release_large_buffers(1)  # once set, it stays set (said once)
else:
    assert not malloc.release_large_buffers(1 << 20)  # small weights: left alone
x = torch.ones(24 << 18)  # 24 MiB, mmap'd; freeing it raises glibc's dynamic threshold to 24 MiB
del x
base = anon()
ys, pins = [], []
for _ in range(20):  # 20 buffers of 6 MiB, each followed by a small block that stays
    ys.append(torch.ones(6 << 18))
    pins.append(torch.ones(16 << 10))
del ys  # holes between the pins: a heap cannot hand them back
print((anon() - base) >> 20)
"""


def _retained_mib(mode: str) -> tuple[int, str]:
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_MMAP_THRESHOLD_"}
    run = subprocess.run([sys.executable, "-c", SCRIPT, mode], cwd=ROOT, env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    return int(run.stdout.split()[-1]), run.stderr


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc and /proc are Linux's")
def test_fixed_threshold_returns_freed_buffers():
    kept, said = _retained_mib("off")
    assert kept >= 100 and "[qwen35]" not in said  # glibc's default keeps the 120 MiB in its heap
    kept, said = _retained_mib("on")
    assert kept < 20 and said.count("go back to the OS when freed") == 1
