"""Batch video captioning: `python -m app.caption INPUT... --out captions.jsonl`.

Writes one JSON line per video: path (absolute), caption, thinking, frames (count), timestamps
(seconds of the frames used), duration (seconds), error (null, or why the video has no caption),
finish_reason, completion_tokens and seconds (the video's decode time plus its time in the engine).
Videos already captioned in the output file are skipped, so rerunning the same command resumes an
interrupted run; a crash loses at most the videos in flight. Videos with only error records are
skipped too, unless `--retry-errors` asks to caption them again.

    python -m app.caption videos/ --out captions.jsonl --model /models/Qwen3.5-35B-A3B --device cuda
    # a SLURM array, one output per shard:
    python -m app.caption videos/ --shard $SLURM_ARRAY_TASK_ID/$SLURM_ARRAY_TASK_COUNT \
        --out captions.$SLURM_ARRAY_TASK_ID.jsonl
    # a Ray cluster (pip install -e '.[ray]'), a folder of part files as output (app/caption_ray.py):
    python -m app.caption --ray --ray-address auto --actors 16 videos/ --out captions/
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import sys
from collections.abc import Callable
from typing import Any, TypeVar

import torch
from tqdm import tqdm

from mm import ModelConfig
from preprocess.video import MIN_FRAMES

from .caption_inputs import expand_inputs, in_shard, parse_shard, read_schema
from .caption_run import load_job, run
from .caption_store import CaptionStore, pending
from .loading import add_model_arguments, check_model, device_problem

RAY_INSTALL = "pip install -e '.[ray]' (ray[data] 2.60)"
# the cluster options, their defaults with --ray (None: decided by app.caption_ray); each needs --ray
RAY_DEFAULTS = dict(ray_address=None, actors=None, cpus_per_actor=1.0, gpus_per_actor=None, videos_per_task=None,
                    format="jsonl")  # fmt: skip

DEFAULT_PROMPT = "Describe this video in detail."


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line of `python -m app.caption`; every option is checked here, before any video is read."""
    parser = argparse.ArgumentParser(prog="python -m app.caption", description=__doc__.split("\n\n")[0])
    parser.add_argument("inputs", nargs="+", metavar="INPUT",
                        help="video files, URLs, folders (searched recursively), quoted globs, or "
                             ".txt/.csv/.jsonl/.parquet lists of paths and URLs")
    parser.add_argument("--out", required=True,
                        help="output .jsonl file (appended to; videos already captioned in it are skipped); with "
                             "--ray a folder or object-store URI of part files")
    add_model_arguments(parser)
    default = " (default: %(default)s)"
    parser.add_argument("--prompt", default=DEFAULT_PROMPT, help="the question asked about every video" + default)
    parser.add_argument("--fps", type=float, default=2.0, help="frames sampled per second of video" + default)
    parser.add_argument("--max-frames", type=int, default=64,
                        help=f"at most this many frames per video, at least {MIN_FRAMES}" + default)
    parser.add_argument("--batch-size", type=int, default=4, help="videos generating at once (a new one starts as soon as one ends)" + default)
    parser.add_argument("--workers", type=int, default=2, help="decoding threads, ahead of generation" + default)
    parser.add_argument("--max-new-tokens", type=int, default=512, help="caption length limit in tokens" + default)
    parser.add_argument("--preset", default=None, choices=["thinking", "instruct", "greedy"],
                        help="sampling preset (default: the checkpoint's generation_config.json)")
    parser.add_argument("--seed", type=int, default=None, help="sampling seed (default: not seeded)")
    parser.add_argument("--thinking", action="store_true", help="let the model think before captioning")
    parser.add_argument("--thinking-budget", type=int, metavar="N", default=None,
                        help="with --thinking: at most N thinking tokens, then the thinking is closed and the "
                             "caption follows (default: no limit)")  # fmt: skip
    parser.add_argument("--json-schema", metavar="FILE", default=None,
                        help="a JSON schema file: each caption is generated to follow it (compact JSON, "
                             "grammar-constrained) and recorded as the parsed object; an output that does not "
                             "parse and validate (e.g. cut by --max-new-tokens) becomes an error record")  # fmt: skip
    parser.add_argument("--shard", default="0/1", help="i/n: only shard i of n, split by a hash of the path" + default)
    parser.add_argument("--retry-errors", action="store_true",
                        help="caption again the videos that have only error records in --out (captioned ones "
                             "are never redone)")  # fmt: skip
    _add_ray_arguments(parser)
    args = parser.parse_args(argv)
    problems = _option_problems(args) + _ray_problems(args)
    if problems:
        parser.error("; ".join(problems))
    args.shard = parse_shard(args.shard)
    if args.ray:
        _fill_ray_defaults(args)
    return args


def _add_ray_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(f"on a Ray cluster (Ray Data; {RAY_INSTALL})")
    group.add_argument("--ray", action="store_true",
                       help="caption through Ray Data on an actor pool; --out is then a folder of part files")
    group.add_argument("--ray-address", metavar="ADDR",
                       help="the cluster to join, e.g. auto or HEAD:6379 (default: $RAY_ADDRESS, else a local cluster)")
    group.add_argument("--actors", type=int, metavar="N",
                       help="actors, each one pipeline (default: as many as the cluster's CPUs, or GPUs, hold)")
    group.add_argument("--cpus-per-actor", type=float, metavar="C", help="CPUs of one actor (default: 1)")
    group.add_argument("--gpus-per-actor", type=float, metavar="G",
                       help="GPUs of one actor (default: 1 with --device cuda, else 0)")
    group.add_argument("--videos-per-task", type=int, metavar="N",
                       help="videos in one map task and one part file; an actor takes two at a time (default: 4 x "
                            "--batch-size, fewer in a small run so that every actor gets two)")
    group.add_argument("--format", choices=["jsonl", "parquet"], help="the part files' format (default: jsonl)")


def _ray_problems(args: argparse.Namespace) -> list[str]:
    given = [f"--{name.replace('_', '-')}" for name in RAY_DEFAULTS if getattr(args, name) is not None]
    if not args.ray:
        return [f"{', '.join(given)} {'needs' if len(given) == 1 else 'need'} --ray"] if given else []
    if importlib.util.find_spec("ray") is None:
        return [f"--ray needs Ray Data, which is not installed: {RAY_INSTALL}"]
    checks = [("actors", lambda n: n >= 1, ">= 1"), ("videos_per_task", lambda n: n >= 1, ">= 1"),
              ("cpus_per_actor", lambda n: n > 0, "> 0"), ("gpus_per_actor", lambda n: n >= 0, ">= 0")]
    return [f"--{name.replace('_', '-')} must be {rule}, got {getattr(args, name)}"
            for name, ok, rule in checks if getattr(args, name) is not None and not ok(getattr(args, name))]


def _ray_device_problem(device: str) -> str | None:
    """With --ray the device is the actors' (on any node), so only its form is checked here."""
    try:
        parsed = torch.device(device)
    except RuntimeError as error:
        return f"--device {device}: not a torch device ({error})"
    if parsed.type == "cuda" and parsed.index is not None:
        return f"--device {device}: with --ray each actor is given its own GPUs (--gpus-per-actor); use --device cuda"
    return None


def _fill_ray_defaults(args: argparse.Namespace) -> None:
    for name, default in RAY_DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, default)
    if args.gpus_per_actor is None:
        args.gpus_per_actor = 1.0 if torch.device(args.device).type == "cuda" else 0.0


def _option_problems(args: argparse.Namespace) -> list[str]:
    problems = [f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}"
                for name in ("batch_size", "workers", "max_new_tokens") if getattr(args, name) < 1]  # fmt: skip
    if args.thinking_budget is not None and (args.thinking_budget < 0 or not args.thinking):
        problems.append(f"--thinking-budget {args.thinking_budget} needs --thinking and a value >= 0")
    if args.json_schema is not None:
        try:
            args.json_schema = read_schema(args.json_schema)
        except ValueError as error:
            problems.append(str(error))
    if args.max_frames < MIN_FRAMES:
        problems.append(f"--max-frames {args.max_frames} is below {MIN_FRAMES}, the fewest frames a video is "
                        f"sampled to; use --max-frames {MIN_FRAMES} or more")  # fmt: skip
    if not (math.isfinite(args.fps) and args.fps > 0):
        problems.append(f"--fps must be a positive number, got {args.fps}")
    if not args.prompt.strip():
        problems.append("--prompt is empty")
    if (problem := (_ray_device_problem if args.ray else device_problem)(args.device)) is not None:
        problems.append(problem)
    try:
        parse_shard(args.shard)
    except ValueError as error:
        problems.append(str(error))
    return problems


def main(argv: list[str] | None = None) -> int:
    """Run the captioner; returns the exit status (0 also when some videos got error records).
    A missing input, an unusable model or output file ends it with a one-line `error:` message."""
    args = parse_args(argv)
    model_path = checked(lambda: check_model(args.model))  # fail (or announce the random model) before any work
    context = ModelConfig.from_pretrained(model_path).text.max_position_embeddings  # (read by check_model)
    if args.max_new_tokens >= context:
        raise SystemExit(f"error: --max-new-tokens {args.max_new_tokens} leaves no room for a video in the "
                         f"model's context of {context} tokens")  # fmt: skip
    paths = checked(lambda: [p for p in expand_inputs(args.inputs) if in_shard(p, *args.shard)])
    if args.ray:
        return _ray_main()(args, paths)
    with checked(lambda: CaptionStore(args.out)) as store:
        todo = pending(paths, store, args.retry_errors)
        print(plan_line(paths, store, args, len(todo)), file=sys.stderr)
        if not todo:
            store.finish()
            return 0
        pipeline, job = checked(lambda: load_job(args, model_path))
        with tqdm(total=len(todo), unit="video", dynamic_ncols=True, smoothing=0.1) as bar:
            errors = run(pipeline, todo, store, job, batch_size=args.batch_size, workers=args.workers, progress=bar)
        store.finish()
    print(f"done: {len(todo) - errors} captioned, {errors} errors, written to {args.out}", file=sys.stderr)
    return 0


def plan_line(paths: list[str], store: Any, args: argparse.Namespace, todo: int) -> str:
    """The line that says what this run will do; `store` has the `captioned` and `failed` sets."""
    captioned = sum(p in store.captioned for p in paths)
    failed = sum(p in store.failed for p in paths)
    retry = "retried" if args.retry_errors else "skipped; --retry-errors retries them"
    errors = f", {failed} with error records ({retry})" if failed else ""
    return (f"{len(paths)} videos in shard {args.shard[0]}/{args.shard[1]}: {captioned} already captioned in "
            f"{args.out}{errors}, {todo} to caption")  # fmt: skip


def _ray_main() -> Callable[[argparse.Namespace, list[str]], int]:
    from . import caption_ray  # needs ray, checked by parse_args

    return caption_ray.main


T = TypeVar("T")


def checked(step: Callable[[], T]) -> T:
    """`step()`, with the errors a user causes (a missing file, an unusable model or output) as
    `error: ...` lines instead of tracebacks."""
    try:
        return step()
    except (OSError, ValueError, RuntimeError) as error:
        raise SystemExit(f"error: {error}") from None


if __name__ == "__main__":
    sys.exit(main())
