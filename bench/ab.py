"""A/B of two versions of the CPU kernels in one process: the current tree against a git revision.

    python -m bench.ab [--base REV] [--checkpoint DIR] [--formats bf16,int4] [--batch 1]
                       [--rounds 8] [--products] [--base-isa native|avx2] [--isa native|avx2]

Builds the kernels of `--base` (default HEAD: the committed version, against the uncommitted edits)
in a temporary git worktree, and the current tree's, loads both modules into this process and runs
the same work through each in turn: whole greedy decode steps of a checkpoint (default: a random one
with bench/lm.py's proportions, as bench.formats makes), or with `--products` the decode products
of bench.products (as many bytes as it streams; with `--batch` over 8, the prefill products of
int8 / int4 weights, `int8_linear`, in GFLOP/s). Each round runs A then B or B then A
(alternating), and the medians over rounds are compared. This machine's memory moves between states (read bandwidth ~30 and ~60 GB/s, within
seconds) that shift a single run by up to 40%, more than most changes a kernel edit makes; runs
taken in turns see the same states, so their ratio keeps what separate runs lose in the noise.
`--base-isa` / `--isa` build A / B for that instruction set (QWEN35_CPU_ISA, lm/kernels/build.py):
`--base-isa avx2` with no edits compares the AVX2 build with this CPU's own.

    python -m bench.ab --bf16-layouts [--checkpoint DIR] [--batches 1,4,8] [--rounds 8] [--isa native|avx2]

compares two weight layouts instead of two builds: the checkpoint loaded twice in bf16, A with its
matrices in rows (QWEN35_BF16_GROUPS=0), B in groups of 8 rows (=1), whole decode steps of both
through the current tree's kernels for `--isa`, in turns, at each batch size.

The base must have the DecodePlan binding marked module_local, or be loaded before one that has
(the base loads first), for two builds to live in one process, and take each weight with its format
code (formats.h: Weight), as the current tree's Python passes them. A build takes ~90 s on 2 cores the
first time; both are cached by the hash of their sources (lm/kernels/build.py).
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from lm import kernels
from lm.kernels.build import ISA_FLAGS, _import

ROOT = Path(__file__).resolve().parent.parent


def build(tree: Path, isa: str = "native") -> Path:
    """Build (or find) the kernels of the checkout at `tree` for `isa`; returns the .so's path."""
    env = dict(os.environ, QWEN35_CPU_ISA=isa)
    run = subprocess.run([sys.executable, "-m", "lm.kernels.build"], cwd=tree, capture_output=True, text=True, env=env)
    found = re.search(r"CPU kernels ready[^:]*: (\S+\.so)", run.stdout + run.stderr)
    if run.returncode or not found:
        raise SystemExit(f"the kernels of {tree} did not build:\n{run.stdout}{run.stderr}")
    return Path(found.group(1))


def build_revision(rev: str, isa: str = "native") -> Path:
    """The kernels of git revision `rev` for `isa`, built in a temporary worktree (removed afterwards)."""
    with tempfile.TemporaryDirectory() as tmp:
        tree = Path(tmp) / "tree"
        subprocess.run(["git", "worktree", "add", "--detach", "-q", str(tree), rev], cwd=ROOT, check=True)
        try:
            return build(tree, isa)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT, check=True)


def alternate(a, b, rounds: int, run) -> tuple[float, float]:
    """Median of `run(module)` over `rounds` turns of each, A and B in alternating order."""
    got = {id(a): [], id(b): []}
    for i in range(rounds):
        for m in (a, b) if i % 2 == 0 else (b, a):
            got[id(m)].append(run(m))
    return statistics.median(got[id(a)]), statistics.median(got[id(b)])


def decode_rate(model, ids: torch.Tensor, module, new: int = 48) -> float:
    """Tokens/s of a greedy generation with `module` as the kernels (each generation builds its
    decode plan from the module in use)."""
    from lm import SamplingParams, stream_generate

    kernels._state["module"] = module
    stamps = [time.perf_counter() for e in stream_generate(model.lm, ids, SamplingParams(max_new_tokens=new))
              if e.row == 0]
    return (len(stamps) - 1) / (stamps[-1] - stamps[0]) * ids.shape[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base", default="HEAD", help="git revision of the A kernels (B: the current tree)")
    parser.add_argument("--checkpoint", type=Path, default=None, help="a bf16 checkpoint (default: make one)")
    parser.add_argument("--formats", default="bf16,int4")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--products", action="store_true", help="the decode products alone (bench.products)")
    parser.add_argument("--base-isa", default="native", choices=ISA_FLAGS, help="instruction set of A's build")
    parser.add_argument("--isa", default="native", choices=ISA_FLAGS, help="instruction set of B's build")
    parser.add_argument("--bf16-layouts", action="store_true",
                        help="bf16 rows (A) against bf16 rows in groups of 8 (B), the current tree's kernels")
    parser.add_argument("--batches", default="1,4,8", help="with --bf16-layouts: the decode batches")
    args = parser.parse_args()
    if args.bf16_layouts:
        return bf16_layouts(args)

    print(f"building the kernels of {args.base} for {args.base_isa} (A) and of the current tree for {args.isa} (B) ...",
          flush=True)
    a_path, b_path = build_revision(args.base, args.base_isa), build(ROOT, args.isa)
    print(f"A: {a_path}\nB: {b_path}")
    if a_path == b_path:
        raise SystemExit("A and B are the same build (no change to lm/kernels): nothing to compare")
    a, b = (_import(p.stem, p) for p in (a_path, b_path))  # the base first (see the module docstring)

    from bench.limits import ReadBandwidth

    probe = ReadBandwidth(1.0)
    formats = args.formats.split(",")
    if args.products:
        from bench.products import SHAPES, streamed_shapes, weights_in
        from lm.formats import policy

        prefill = args.batch > kernels.MAX_ROWS  # int8_linear, rated in FLOP/s (compute-bound)
        if prefill and set(formats) - {"int8", "int4"}:
            raise SystemExit(f"--products with more than {kernels.MAX_ROWS} rows: int8 / int4 only")
        for fmt in formats:
            stored = policy.storage(fmt, kernels.bf16_groups())  # bf16: in groups of 8 rows where the policy would
            shapes = SHAPES[:8] if prefill else streamed_shapes(stored)  # decode: far more than the L3
            weights = [(w, torch.randn(args.batch, k)) for w, (_, k) in zip(weights_in(stored, shapes), shapes)]
            total = sum(2 * args.batch * k * n if prefill else w.numel() * w.element_size()
                        for (w, _), (n, k) in zip(weights, shapes))

            def run(module, weights=weights, total=total):
                start = time.perf_counter()
                for w, x in weights:
                    if prefill:
                        module.int8_linear(x, (w, stored.code))
                    else:
                        module.small_m_linear(x, (w, stored.code), kernels._NO_PANELS)
                return total / (time.perf_counter() - start)

            ra, rb = alternate(a, b, args.rounds, run)
            unit = "GFLOP/s" if prefill else "GB/s"
            print(f"{fmt} products, {args.batch} row(s): A {ra / 1e9:.1f} {unit}, B {rb / 1e9:.1f} {unit}, "
                  f"B/A {rb / ra:.3f} (read bandwidth now {probe(3) / 1e9:.0f} GB/s)", flush=True)
        return

    import mm
    from bench.formats import make_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        path = args.checkpoint or make_checkpoint(Path(tmp) / "bench-bf16", 248320)
        for fmt in formats:
            model = mm.load_model(path, weights=fmt)
            ids = torch.randint(0, model.config.text.vocab_size, (args.batch, 8), generator=torch.Generator().manual_seed(1))
            decode_rate(model, ids, a, 8)  # warm-up of both
            decode_rate(model, ids, b, 8)
            ra, rb = alternate(a, b, args.rounds, lambda m: decode_rate(model, ids, m))
            print(f"{fmt} decode, batch {args.batch}: A {ra:.1f} tok/s, B {rb:.1f} tok/s, B/A {rb / ra:.3f} "
                  f"(read bandwidth now {probe(3) / 1e9:.0f} GB/s)", flush=True)
            del model


def bf16_layouts(args) -> None:
    """--bf16-layouts: one build, two models of the same checkpoint (bf16 rows, groups of 8 rows)."""
    import mm
    from bench.formats import make_checkpoint
    from bench.limits import ReadBandwidth

    so = build(ROOT, args.isa)
    module = _import(so.stem, so)
    kernels._state["module"] = module
    probe = ReadBandwidth(1.0)
    with tempfile.TemporaryDirectory() as tmp:
        path = args.checkpoint or make_checkpoint(Path(tmp) / "bench-bf16", 248320)
        models = []
        for groups in ("0", "1"):
            os.environ["QWEN35_BF16_GROUPS"] = groups
            models.append(mm.load_model(path, weights="bf16"))
        del os.environ["QWEN35_BF16_GROUPS"]
        for batch in (int(b) for b in args.batches.split(",")):
            ids = torch.randint(0, models[0].config.text.vocab_size, (batch, 8), generator=torch.Generator().manual_seed(1))
            for model in models:
                decode_rate(model, ids, module, 8)  # warm-up (and the panel copies, from 5 rows)
            rows, groups = alternate(*models, args.rounds, lambda m: decode_rate(m, ids, module))
            print(f"bf16 decode, batch {batch}: rows {rows:.1f} tok/s, groups of 8 rows {groups:.1f} tok/s, "
                  f"groups/rows {groups / rows:.3f} (read bandwidth now {probe(3) / 1e9:.0f} GB/s)", flush=True)


if __name__ == "__main__":
    main()
