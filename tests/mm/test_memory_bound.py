"""Memory per request is bounded (issue 43): 5,000 short messages in one conversation once took the
server from 2.7 to 23 GB (a prefix snapshot per message start, freed only by Python's cyclic
collector). Run in a subprocess that watches its own RSS and stops itself above a hard cap, so that
a regression fails this test instead of waking the host's OOM killer."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = [pytest.mark.subprocess, pytest.mark.slow]

PREFIX_CACHE_MB = 256
GROWTH_BOUND_MB = 1536  # the prefix cache's budget, 8 slots of 32k positions, one prefill cache, slack
HARD_CAP_MB = 6144  # the child stops itself here (before the fix it passed 20 GB)

CHILD = textwrap.dedent(f"""
    import os, threading, time
    from app import default_model_path
    from lm import SamplingParams
    from mm import Pipeline

    def rss_mb():
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024

    pipeline = Pipeline.from_pretrained(default_model_path(),
                                        engine_options=dict(prefix_cache_bytes={PREFIX_CACHE_MB} << 20))
    base, peak = rss_mb(), [0.0]

    def watch():
        while True:
            peak[0] = max(peak[0], rss_mb())
            if peak[0] > {HARD_CAP_MB}:
                print(f"hard cap: {{peak[0]:.0f}} MB", flush=True)
                os._exit(3)
            time.sleep(0.02)

    threading.Thread(target=watch, daemon=True).start()
    messages = [dict(role=("user", "assistant")[i % 2], content="a") for i in range(5001)]
    [out] = pipeline.generate([messages], SamplingParams(max_new_tokens=4))
    time.sleep(0.05)
    print(f"prompt_tokens={{out.prompt_tokens}} growth_mb={{peak[0] - base:.0f}}", flush=True)
""")


def test_five_thousand_messages_stay_within_the_bound():
    done = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=240,
                          cwd=Path(__file__).parents[2])  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    fields = dict(item.split("=") for item in done.stdout.split()[-2:])
    assert int(fields["prompt_tokens"]) > 25000
    assert float(fields["growth_mb"]) < GROWTH_BOUND_MB, done.stdout
