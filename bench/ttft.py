"""Time to the first token: LM prefill and the vision tower per compute format (lm/kernels/compute.py).

    python -m bench.ttft [--checkpoint DIR] [--weights bf16,int8,int4] [--tokens 512,2048]
                         [--vision-depth 6] [--rounds 2] [--computes int8]

LM prefill: one prompt of each length (last token's logits, as llama-bench's pp), for each weight
format loaded once per compute format (fp32, and the others that apply, or those of `--computes`);
the formats take turns, best of `--rounds`, and each speedup is the median of the rounds' paired
ratios. Default checkpoint: a random one with bench/lm.py's proportions (bench.formats),
written to a temporary folder. Vision: the Qwen3.5-35B-A3B tower's sizes (hidden 1152, depth 27;
`--vision-depth` blocks are built and the time scaled to 27, each block costing the same) on a
1024 x 1024 image (4,096 patches, 1,024 LM tokens), float32 against bf16 products.

Each figure is printed beside its ratio to fp32 compute and its share of the compute limit of the
instruction used, as probed here right before: torch's float32 SGEMM, its bf16 GEMM (oneDNN: AMX or
AVX512-BF16 where present) and `torch._int_mm` (int8) on 2048^3, each where native;
for an AVX2 build (no VNNI, no AMX) the int8 limit is vpmaddubsw's peak in registers (the kernels'
instruction_peak), and without AVX512-BF16 or AMX bf16 has none (emulated).
"""

from __future__ import annotations

import argparse
import math
import statistics
import tempfile
import time
from pathlib import Path

import torch

import mm
from bench.formats import make_checkpoint, prefill_rounds
from bench.lm import prefill_flops
from bench.limits import best_time, matmul_flops
from bench.vision import build_towers, vision_flops
from lm.kernels import compute
from mm.loading import set_vision_compute

COMPUTES = {"bf16": ("fp32", "bf16"), "int8": ("fp32", "bf16", "int8"), "int4": ("fp32", "bf16", "int8")}


def peaks(module, n: int = 2048) -> dict[str, tuple[float, str]]:
    """Per compute format, the limit its figures are shares of: (op/s, what it is). torch's GEMM on
    n^3 where it is native (float32 SGEMM; bf16 on CPUs with AVX512-BF16 or AMX; `torch._int_mm` for
    kernels built with VNNI or AMX); for the int8 products of an AVX2 build, their own instruction
    (vpmaddubsw) at its peak in registers (the kernels' instruction_peak); for bf16 on other CPUs
    none (nan: emulated)."""
    out = {"fp32": (matmul_flops(n), "GEMM limit")}
    if compute.cpu_flags() & {"avx512_bf16", "amx_bf16"}:
        a16, b16 = torch.randn(n, n).bfloat16(), torch.randn(n, n).bfloat16()
        out["bf16"] = (2 * n**3 / best_time(lambda: a16 @ b16), "GEMM limit")
    else:
        out["bf16"] = (float("nan"), "emulated here")
    if module is None or not module.INT8_DOT:
        out["int8"] = (float("nan"), "no int8 dot products in this build")
    elif module.VNNI or compute.tiles(module):
        a8, b8 = torch.randint(-127, 127, (n, n), dtype=torch.int8), torch.randint(-127, 127, (n, n), dtype=torch.int8)
        out["int8"] = (2 * n**3 / best_time(lambda: torch._int_mm(a8, b8)), "GEMM limit")
    else:  # an AVX2 build: torch's int8 GEMM is no native limit there, the products' instruction is
        out["int8"] = (max(module.instruction_peak("int8") for _ in range(3)), "vpmaddubsw peak")
    return out


def share(ops_per_s: float, c: str, limit: dict) -> str:
    """'62% of the int8 GEMM limit', or why there is no limit."""
    peak, what = limit[c]
    return f"no {c} limit: {what}" if math.isnan(peak) else f"{ops_per_s / peak:.0%} of the {c} {what}"


def paired(times: list[float], fp32: list[float]) -> str:
    """The speedup over fp32 compute as the median of the rounds' ratios (each round's two prefills
    ran one after the other) and their range: this VM's speed moves by 10-50% within minutes, which
    the best times of each format, taken in different rounds, do not cancel."""
    ratios = sorted(f / t for f, t in zip(fp32, times))
    return f"{statistics.median(ratios):.2f}x fp32 compute, rounds {ratios[0]:.2f}-{ratios[-1]:.2f}"


def lm_prefill(path: Path, weights: list[str], tokens: list[int], rounds: int, limit: dict,
               computes: set[str] | None = None) -> None:
    for fmt in weights:
        keep = COMPUTES[fmt] if not computes else [c for c in COMPUTES[fmt] if c == "fp32" or c in computes]  # fp32: every ratio's base
        models = {c: mm.load_model(path, weights=fmt, compute=c) for c in keep}
        for t in tokens:
            times = prefill_rounds(models, t, rounds)  # seconds per round and compute format, in turns
            flops = prefill_flops(next(iter(models.values())), t)
            for c, seconds in times.items():
                rate = t / min(seconds)
                speedup = paired(seconds, times["fp32"]) if c != "fp32" else "the reference"
                print(f"prefill {t:5d} tokens, {fmt} weights, {c:4s} compute: {rate:7.1f} tok/s, best of {rounds} "
                      f"({speedup}; {share(flops * rate / t, c, limit)})")
        del models


def vision(depth: int, rounds: int, limit: dict) -> None:
    ours, _ = build_towers(depth)
    side = 1024
    grid = (1, side // 16, side // 16)
    pixels, grid_thw = torch.randn(grid[1] * grid[2], ours.config.patch_dim), torch.tensor([grid])
    # the matrices as a bf16 checkpoint holds them: bf16 storage under bf16 compute (as loading
    # keeps them), float32 copies of the same values under fp32 compute (no conversion per call)
    ours.store_matrices_in(torch.bfloat16)
    storage = {"fp32": torch.float32, "bf16": torch.bfloat16}
    times, out = {}, {}
    with torch.inference_mode():
        for _ in range(rounds):
            for c in ("fp32", "bf16"):
                ours.store_matrices_in(storage[c])
                set_vision_compute(c, ours)
                out[c] = ours(pixels, grid_thw)  # warm-up, and the features compared below
                times[c] = min(times.get(c, float("inf")), best_time(lambda: ours(pixels, grid_thw), repeats=1, warmup=0))
    err = float((out["bf16"] - out["fp32"]).abs().max() / out["fp32"].abs().max())
    flops = vision_flops(ours.config, grid)
    for c, seconds in times.items():
        full = seconds * 27 / depth
        print(f"vision tower, 1,024-token image, {c} compute: {full:.2f} s at depth 27 ({depth} blocks timed; "
              f"{times['fp32'] / seconds:.2f}x fp32; {share(flops / seconds, c, limit)})")
    print(f"vision tower bf16 features against fp32: max error {err:.2e} of their range")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", type=Path, default=None)
    parser.add_argument("--weights", default="bf16,int8,int4")
    parser.add_argument("--tokens", default="512")
    parser.add_argument("--vision-depth", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--computes", default="", help="LM prefill: only these compute formats (fp32 always runs)")
    parser.add_argument("--vocab", type=int, default=32768, help="vocabulary of the default checkpoint")
    args = parser.parse_args()
    torch.set_num_threads(min(2, torch.get_num_threads()))
    from lm import kernels

    module = kernels._kernels()
    limit = peaks(module)
    print(f"threads {torch.get_num_threads()}, AMX products {bool(module and module.amx_ready())}; limits: "
          + ", ".join(f"{c} none ({what})" if math.isnan(v) else f"{c} {v / 1e9:.0f} G/s ({what})" for c, (v, what) in limit.items()))
    with tempfile.TemporaryDirectory() as tmp:
        path = args.checkpoint or make_checkpoint(Path(tmp) / "bench", args.vocab)
        started = time.perf_counter()
        computes = set(args.computes.split(",")) if args.computes else None
        lm_prefill(path, args.weights.split(","), [int(t) for t in args.tokens.split(",")], args.rounds, limit, computes)
        print(f"(LM part {time.perf_counter() - started:.0f} s)")
    if args.vision_depth:
        vision(args.vision_depth, args.rounds, limit)


if __name__ == "__main__":
    main()
