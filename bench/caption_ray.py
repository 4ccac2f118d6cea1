"""The Ray captioner against the single-process one on the same short videos: wall time and videos per hour.

    python -m bench.caption_ray [--videos 8] [--tokens 1,128] [--repeat 2]

Writes `--videos` short test videos (64x48, 2-3 s), then runs, each as a fresh command and timed
from start to exit (what a user waits for), alternately `--repeat` times and keeping the fastest:
  single:  python -m app.caption VIDEOS --out captions.jsonl
  ray:     python -m app.caption --ray VIDEOS --out parts/ (a local cluster of this machine's CPUs,
           the default pool: one actor of 1 CPU per CPU)
  ray 1x2: the same with --actors 1 --cpus-per-actor 2
with the built-in model (random weights), `--seed 0` and each of `--tokens` as --max-new-tokens
(1: start-up only; more: start-up plus captioning). Counts the records equal to the single-process
ones but for "seconds" (the last run's): a long caption can differ in its last tokens where the
engine's batch and thread count differ (an actor of 1 CPU computes with 1 thread), as float sums
are rounded in another order. `run()` returns the times and the counts as dicts.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tests.preprocess.video_files import encode

REPO = Path(__file__).resolve().parents[1]
VARIANTS = {"single": [], "ray": ["--ray"], "ray 1x2": ["--ray", "--actors", "1", "--cpus-per-actor", "2"]}


def caption_records(out: Path) -> dict[str, dict]:
    """The records of a captions file or parts folder by path, without "seconds"."""
    files = sorted(out.glob("part-*.jsonl")) if out.is_dir() else [out]
    records = [json.loads(line) for file in files for line in file.read_text().splitlines()]
    return {r["path"]: {k: v for k, v in r.items() if k != "seconds"} for r in records}


def timed(command: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(command, cwd=REPO, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - start


def run(videos: int, tokens: list[int], repeat: int) -> tuple[dict[str, dict[int, float]], dict[str, dict[int, int]]]:
    root = Path(tempfile.mkdtemp(prefix="bench_caption_ray_"))
    (root / "videos").mkdir()
    for i in range(videos):  # as tests/app/conftest.py's write_videos
        encode(root / "videos" / f"clip{i:02d}.mp4", 8 + i % 5, fps=4)
    seconds: dict[str, dict[int, float]] = {name: {} for name in VARIANTS}
    same: dict[str, dict[int, int]] = {name: {} for name in VARIANTS}
    for count in tokens:
        for attempt in range(repeat):
            for name, options in VARIANTS.items():
                out = root / f"{name.replace(' ', '_')}_{count}_{attempt}" / ("captions.jsonl" if not options else "")
                command = [sys.executable, "-m", "app.caption", str(root / "videos"), "--out", str(out), "--seed", "0",
                           "--max-new-tokens", str(count), "--fps", "4", "--max-frames", "8", *options]  # fmt: skip
                took = timed(command)
                seconds[name][count] = min(took, seconds[name].get(count, took))
                reference = caption_records(root / f"single_{count}_{attempt}" / "captions.jsonl")
                same[name][count] = sum(record == reference.get(path) for path, record in caption_records(out).items())
    return seconds, same


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--videos", type=int, default=8)
    parser.add_argument("--tokens", default="1,128", help="comma-separated --max-new-tokens values")
    parser.add_argument("--repeat", type=int, default=2)
    args = parser.parse_args()
    tokens = [int(t) for t in args.tokens.split(",")]
    seconds, same = run(args.videos, tokens, args.repeat)
    print(f"{args.videos} videos, built-in model, fastest of {args.repeat}; wall seconds (videos/hour), "
          "records equal to the single-process ones")
    print(f"{'':>8}" + "".join(f"{f'{t} tokens':>28}" for t in tokens))
    for name, times in seconds.items():
        cells = (f"{times[t]:.1f} s ({args.videos / times[t] * 3600:.0f}/h) {same[name][t]}/{args.videos}"
                 for t in tokens)
        print(f"{name:>8}" + "".join(f"{cell:>28}" for cell in cells))


if __name__ == "__main__":
    main()
