"""Video frame sampling speed: `sample_video` against decoding every frame.

    python -m bench.video [--minutes 10] [--frames 64]

Encodes (once, cached under the system temp dir) a synthetic 1280x720 30 fps H.264 video with a
3-second GOP, then times, each in a fresh subprocess so peak memory is its own:
  sampled: `preprocess.sample_video(path, num_frames=64)` (seeks to the keyframe before each target);
  naive:   decode every frame, convert each to RGB, keep the same 64 frames.
Prints wall time, speedup and peak RSS (VmHWM) and checks both return identical frames.
`run()` returns the numbers as a dict.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import av
import numpy as np

WIDTH, HEIGHT, FPS, GOP_SECONDS = 1280, 720, 30, 3


def video_path(minutes: float) -> Path:
    return Path(tempfile.gettempdir()) / "qwen35_bench" / f"synthetic_{HEIGHT}p_{FPS}fps_{minutes:g}min.mp4"


def encode(path: Path, minutes: float) -> float:
    """Write the benchmark video (ultrafast x264, ~1 Mbit/s); return seconds spent."""
    start = time.perf_counter()
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".partial.mp4")
    canvas = _texture()  # [H * 3/2 + margin, W + margin] uint8, yuv420p layout
    with av.open(str(partial), "w") as out:
        stream = out.add_stream("libx264", rate=FPS)
        stream.width, stream.height, stream.pix_fmt = WIDTH, HEIGHT, "yuv420p"
        stream.codec_context.gop_size = GOP_SECONDS * FPS
        stream.options = {"preset": "ultrafast", "b": "1000k", "maxrate": "1000k", "bufsize": "2000k"}
        for i in range(int(minutes * 60 * FPS)):
            out.mux(stream.encode(av.VideoFrame.from_ndarray(_frame(canvas, i), format="yuv420p")))
        out.mux(stream.encode())
    partial.rename(path)
    return time.perf_counter() - start


def _texture() -> np.ndarray:
    rng = np.random.default_rng(0)
    rows, cols = HEIGHT * 3 // 2 + 256, WIDTH + 256
    y, x = np.mgrid[0:rows, 0:cols]
    smooth = (128 + 60 * np.sin(x / 37.0) * np.cos(y / 23.0)).astype(np.int16)
    return np.clip(smooth + rng.integers(-20, 20, (rows, cols)), 0, 255).astype(np.uint8)


def _frame(canvas: np.ndarray, i: int) -> np.ndarray:
    """yuv420p frame [H * 3/2, W]: a window sliding over the texture, with the frame number as a bar."""
    dy, dx = (i * 3) % 256, (i * 5) % 256
    frame = canvas[dy:dy + HEIGHT * 3 // 2, dx:dx + WIDTH].copy()
    frame[:32, : (i % WIDTH)] = 255
    return frame


def _indices(total: int, count: int) -> list[int]:
    return np.linspace(0, total - 1, count).round().astype(int).tolist()


def _worker(mode: str, path: str, count: int, out: str) -> None:
    """Runs in a fresh process: one method, its time and peak RSS; frames saved for the comparison."""
    import preprocess  # same imports in both modes, so the memory baselines match

    baseline = _peak_rss_kib()
    start = time.perf_counter()
    if mode == "sampled":
        frames = preprocess.sample_video(path, num_frames=count).frames
    else:
        frames = _decode_everything(path, count)
    seconds = time.perf_counter() - start
    peak = _peak_rss_kib()
    np.save(out, frames)
    print(json.dumps({"seconds": seconds, "peak_rss_mib": peak / 1024, "baseline_rss_mib": baseline / 1024}))


def _peak_rss_kib() -> int:
    """This process's peak resident set (VmHWM). Unlike ru_maxrss it starts afresh at exec, so a
    worker started from a large parent (e.g. bench.vision) reports its own peak."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def _decode_everything(path: str, count: int) -> np.ndarray:
    with av.open(path) as container:
        stream = container.streams.video[0]
        stream.thread_type = "AUTO"
        keep = set(_indices(stream.frames, count))
        frames = []
        for i, frame in enumerate(container.decode(stream)):
            rgb = frame.to_ndarray(format="rgb24")  # every frame converted, as a naive loader does
            if i in keep:
                frames.append(rgb)
    return np.stack(frames)


def _measure(mode: str, path: Path, count: int, folder: Path) -> tuple[dict, np.ndarray]:
    out = folder / f"{mode}.npy"
    result = subprocess.run([sys.executable, "-m", "bench.video", "--worker", mode, str(path), str(count), str(out)],
                            capture_output=True, text=True, check=True)
    return json.loads(result.stdout.strip().splitlines()[-1]), np.load(out)


def run(minutes: float = 10, frames: int = 64) -> dict:
    """Encode (or reuse) the video, time both methods in fresh processes, return the numbers."""
    path = video_path(minutes)
    encode_seconds = 0.0 if path.exists() else encode(path, minutes)
    with tempfile.TemporaryDirectory() as tmp:
        sampled, ours = _measure("sampled", path, frames, Path(tmp))
        naive, theirs = _measure("naive", path, frames, Path(tmp))
    with av.open(str(path)) as container:
        total = container.streams.video[0].frames
    return {
        "video": str(path), "total_frames": total, "sampled_frames": frames, "encode_seconds": encode_seconds,
        "sampled": sampled, "naive": naive, "speedup": naive["seconds"] / sampled["seconds"],
        "identical_frames": bool(np.array_equal(ours, theirs)),
        "sampled_frames_mib": ours.nbytes / 2**20, "all_frames_rgb_mib": total * HEIGHT * WIDTH * 3 / 2**20,
    }


def _print(r: dict) -> None:
    print(f"video: {r['video']} ({r['total_frames']} frames, {WIDTH}x{HEIGHT} H.264, GOP {GOP_SECONDS} s)"
          + (f", encoded in {r['encode_seconds']:.1f} s" if r["encode_seconds"] else ", cached"))
    print(f"{'method':<34}{'time (s)':>10}{'peak RSS (MiB)':>16}{'RSS growth (MiB)':>18}")
    for name, m in (("sample_video(num_frames=%d)" % r["sampled_frames"], r["sampled"]),
                    ("naive: decode all + RGB each", r["naive"])):
        growth = m["peak_rss_mib"] - m["baseline_rss_mib"]
        print(f"{name:<34}{m['seconds']:>10.2f}{m['peak_rss_mib']:>16.0f}{growth:>18.0f}")
    print(f"speedup: {r['speedup']:.1f}x; identical frames: {r['identical_frames']}; the {r['sampled_frames']} "
          f"frames hold {r['sampled_frames_mib']:.0f} MiB (all frames as RGB would be {r['all_frames_rgb_mib']:.0f} MiB)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=10)
    parser.add_argument("--frames", type=int, default=64)
    parser.add_argument("--worker", nargs=4, metavar=("MODE", "PATH", "COUNT", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        mode, path, count, out = args.worker
        _worker(mode, path, int(count), out)
        return
    _print(run(args.minutes, args.frames))


if __name__ == "__main__":
    main()
