"""Vision tower throughput: ours vs transformers, against this machine's float32 matmul limit.

    python -m bench.vision [--depth 6] [--reps 3] [--sides 448 1024]

Builds the Qwen3.5-35B-A3B vision tower sizes (hidden 1152, 16 heads, intermediate 4304, out 2048)
with random float32 weights, loads the same weights into transformers' Qwen3_5MoeVisionModel,
and times one image per call (grid_t 1, h = w = side / 16). The full tower has 27 blocks; by
default only 6 are built so a run on a 2-core CPU takes minutes (per-block cost is identical, so the
share of the matmul limit is representative; `--depth 27` runs the real depth).
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import time
from collections.abc import Callable

import torch

from vision import VisionConfig, VisionModel, load_vision_weights

REAL = dict(
    depth=27, hidden_size=1152, num_heads=16, intermediate_size=4304, out_hidden_size=2048,
    num_position_embeddings=2304, patch_size=16, temporal_patch_size=2, spatial_merge_size=2, in_channels=3,
    hidden_act="gelu_pytorch_tanh", deepstack_visual_indexes=[],
)
DEFAULT_DEPTH = 6


def vision_flops(config: VisionConfig, grid: tuple[int, int, int]) -> int:
    """Forward FLOPs (2 per multiply-add) of one image/video: patch embed, blocks, merger."""
    t, h, w = grid
    n, seg, c, i = t * h * w, h * w, config.hidden_size, config.intermediate_size
    per_block = (
        2 * n * c * 3 * c  # qkv
        + 2 * 2 * n * seg * c  # QK^T and PV, all heads, within each frame group
        + 2 * n * c * c  # proj
        + 2 * 2 * n * c * i  # MLP fc1, fc2
    )
    m = config.merge_unit * c
    merger = 2 * (n // config.merge_unit) * m * (m + config.out_hidden_size)
    return 2 * n * config.patch_dim * c + config.depth * per_block + merger


def matmul_flops_per_s(size: int = 2048, reps: int = 5) -> float:
    """Best-of-`reps` float32 FLOP/s of a square `size`^3 matmul (the machine's practical limit)."""
    a, b = torch.randn(size, size), torch.randn(size, size)
    return 2 * size**3 / _times(lambda: a @ b, reps)[0]


def _times(fn: Callable[[], object], reps: int, warmup: int = 1) -> list[float]:
    """Sorted wall times of `reps` calls after `warmup` calls."""
    return _interleaved_times([fn], reps, warmup)[0]


def _interleaved_times(fns: list[Callable[[], object]], reps: int, warmup: int = 1) -> list[list[float]]:
    """Sorted wall times per function; the functions take turns so load changes hit all alike."""
    for _ in range(warmup):
        for fn in fns:
            fn()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(reps):
        for fn, out in zip(fns, times):
            start = time.perf_counter()
            fn()
            out.append(time.perf_counter() - start)
    return [sorted(t) for t in times]


class _StateDictReader:
    """Reader over a state dict, with the checkpoint's `model.visual.` names."""

    def __init__(self, state: dict[str, torch.Tensor]) -> None:
        self._state = {"model.visual." + k: v for k, v in state.items()}

    def keys(self) -> list[str]:
        return list(self._state)

    def get(self, name: str) -> torch.Tensor:
        return self._state[name]


def build_towers(depth: int) -> tuple[VisionModel, torch.nn.Module]:
    """Our tower and transformers' with the same random float32 weights."""
    from transformers import Qwen3_5MoeVisionConfig
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeVisionModel

    torch.manual_seed(0)
    hf_config = Qwen3_5MoeVisionConfig(**{**REAL, "depth": depth})
    hf_config._attn_implementation = "sdpa"
    ref = Qwen3_5MoeVisionModel(hf_config).float().eval()
    ours = VisionModel(VisionConfig.from_hf(hf_config.to_dict())).float().eval()
    load_vision_weights(ours, _StateDictReader(ref.state_dict()))
    return ours, ref


def bench_side(ours: VisionModel, ref: torch.nn.Module, side: int, reps: int) -> dict:
    """Time one side x side image through both towers, taking turns with the 2048^3 matmul."""
    config = ours.config
    grid = (1, side // config.patch_size, side // config.patch_size)
    pixels = torch.randn(grid[0] * grid[1] * grid[2], config.patch_dim)
    grid_thw = torch.tensor([grid])
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    with torch.inference_mode():
        diff = (ours(pixels, grid_thw) - ref(pixels, grid_thw).pooler_output).abs().max().item()
        t_mm, t_ours, t_ref = _interleaved_times(
            [lambda: a @ b, lambda: ours(pixels, grid_thw), lambda: ref(pixels, grid_thw)], reps)
    return {
        "side": side, "grid_thw": list(grid), "tokens": grid[0] * grid[1] * grid[2],
        "flops": vision_flops(config, grid), "matmul_flops_per_s": 2 * 2048**3 / t_mm[0], "max_abs_diff": diff,
        "ours_s": t_ours[0], "ours_median_s": statistics.median(t_ours), "ours_images_per_s": 1 / t_ours[0],
        "ref_s": t_ref[0], "ref_median_s": statistics.median(t_ref), "ref_images_per_s": 1 / t_ref[0],
        "ours_over_ref": t_ref[0] / t_ours[0],
    }


def _report(r: dict, limit: float) -> None:
    full = vision_flops(VisionConfig.from_hf(REAL), tuple(r["grid_thw"]))
    print(f"{r['side']}x{r['side']} ({r['tokens']} patches): {r['flops'] / 1e9:.1f} GFLOP/image "
          f"(full 27-block tower: {full / 1e9:.1f})")
    for who, name in (("ours", "ours"), ("ref", "transformers")):
        print(f"  {name:<12} {r[who + '_images_per_s']:.3f} images/s  ({r[who + '_s'] * 1e3:.0f} ms, median "
              f"{r[who + '_median_s'] * 1e3:.0f} ms)  {100 * r[who + '_share']:.1f}% of matmul limit")
    print(f"  ours/transformers speed {r['ours_over_ref']:.2f}x   max |ours - ref| {r['max_abs_diff']:.2e}")


def run(depth: int = DEFAULT_DEPTH, reps: int = 3, sides: tuple[int, ...] = (448, 1024)) -> dict:
    """Benchmark both towers; return the machine's matmul limit and one result per image side.

    Times are best-of-`reps` wall times. The limit is the best 2048^3 matmul seen over the whole
    run (5 up front, one per repetition between the tower calls), so a busy machine lowers it and
    the towers' times alike. Prints a report.
    """
    limit = matmul_flops_per_s()
    ours, ref = build_towers(depth)
    results = [bench_side(ours, ref, side, reps) for side in sides]
    limit = max([limit] + [r["matmul_flops_per_s"] for r in results])
    print(f"vision bench: Qwen3.5-35B-A3B tower sizes, {depth} of 27 blocks"
          f"{' (reduced depth for CPU time; per-block cost is the same)' if depth != 27 else ''}, float32, "
          f"{torch.get_num_threads()} threads; best of {reps} after 1 warm-up, ours and transformers taking turns")
    print(f"float32 matmul limit (2048^3, best seen): {limit / 1e9:.1f} GFLOP/s")
    for r in results:
        r["ours_share"], r["ref_share"] = r["flops"] / r["ours_s"] / limit, r["flops"] / r["ref_s"] / limit
        _report(r, limit)
    return {"depth": depth, "threads": torch.get_num_threads(), "matmul_flops_per_s": limit, "images": results}


def run_video_bench() -> dict | None:
    """Run the teammate's `bench/video.py` `run()` if it exists; say so clearly if it does not."""
    try:
        module = importlib.import_module("bench.video")
    except ModuleNotFoundError as err:
        if err.name != "bench.video":
            raise
        print("bench.video: not present (bench/video.py missing), skipped")
        return None
    if not callable(getattr(module, "run", None)):
        print("bench.video: bench/video.py has no run() function, skipped")
        return None
    print("bench.video:")
    result = module.run()
    for key, value in (result.items() if isinstance(result, dict) else [("result", result)]):
        print(f"  {key}: {value}")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--depth", type=int, default=DEFAULT_DEPTH, help="blocks to build (27 = full tower)")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--sides", type=int, nargs="+", default=[448, 1024])
    args = parser.parse_args()
    run(args.depth, args.reps, tuple(args.sides))
    run_video_bench()


if __name__ == "__main__":
    main()
