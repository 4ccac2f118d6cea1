"""Batch video captioning: `python -m app.caption INPUT... --out captions.jsonl`.

Writes one JSON line per video: path (absolute), caption, thinking, frames (count), timestamps
(seconds of the frames used), duration (seconds), error (null, or why the video has no caption),
finish_reason, completion_tokens and seconds (the video's decode time plus its share of its batch's
generation time). Videos already in the output file are skipped, so rerunning the same command
resumes an interrupted run; a crash loses at most the batch in flight.

    python -m app.caption videos/ --out captions.jsonl --model /models/Qwen3.5-35B-A3B --device cuda
    # a SLURM array, one output per shard:
    python -m app.caption videos/ --shard $SLURM_ARRAY_TASK_ID/$SLURM_ARRAY_TASK_COUNT \
        --out captions.$SLURM_ARRAY_TASK_ID.jsonl
"""

from __future__ import annotations

import argparse
import sys

from tqdm import tqdm

from .caption_inputs import expand_inputs, in_shard, parse_shard
from .caption_run import CaptionJob, run
from .caption_store import CaptionStore
from .loading import add_model_arguments, load_pipeline, resolve_model

DEFAULT_PROMPT = "Describe this video in detail."


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line of `python -m app.caption`."""
    parser = argparse.ArgumentParser(prog="python -m app.caption", description=__doc__.split("\n\n")[0])
    parser.add_argument("inputs", nargs="+", metavar="INPUT",
                        help="video files, folders (searched recursively) or .txt/.csv/.jsonl lists of paths")
    parser.add_argument("--out", required=True, help="output .jsonl file (appended to; existing videos are skipped)")
    add_model_arguments(parser)
    default = " (default: %(default)s)"
    parser.add_argument("--prompt", default=DEFAULT_PROMPT, help="the question asked about every video" + default)
    parser.add_argument("--fps", type=float, default=2.0, help="frames sampled per second of video" + default)
    parser.add_argument("--max-frames", type=int, default=64, help="at most this many frames per video" + default)
    parser.add_argument("--batch-size", type=int, default=4, help="videos per generation call" + default)
    parser.add_argument("--workers", type=int, default=2, help="decoding threads, ahead of generation" + default)
    parser.add_argument("--max-new-tokens", type=int, default=512, help="caption length limit in tokens" + default)
    parser.add_argument("--preset", default=None, choices=["thinking", "instruct", "greedy"],
                        help="sampling preset (default: the checkpoint's generation_config.json)")
    parser.add_argument("--seed", type=int, default=None, help="sampling seed (default: not seeded)")
    parser.add_argument("--thinking", action="store_true", help="let the model think before captioning")
    parser.add_argument("--shard", default="0/1", help="i/n: only shard i of n, split by a hash of the path" + default)
    args = parser.parse_args(argv)
    for name in ("batch_size", "workers", "max_frames", "max_new_tokens"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    try:
        args.shard = parse_shard(args.shard)
    except ValueError as error:
        parser.error(str(error))
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the captioner; returns the exit status (0 also when some videos got error records)."""
    args = parse_args(argv)
    try:
        model_path = resolve_model(args.model)  # fail (or announce the random model) before any work
    except FileNotFoundError as error:
        raise SystemExit(f"error: {error}") from None
    paths = [p for p in expand_inputs(args.inputs) if in_shard(p, *args.shard)]
    with CaptionStore(args.out) as store:
        todo = [p for p in paths if p not in store.done]
        print(f"{len(paths)} videos in shard {args.shard[0]}/{args.shard[1]}, {len(paths) - len(todo)} already in "
              f"{args.out}, {len(todo)} to caption", file=sys.stderr)  # fmt: skip
        if not todo:
            return 0
        pipeline = load_pipeline(model_path, device=args.device, dtype=args.dtype, weights=args.weights)
        params = pipeline.default_params(args.preset, max_new_tokens=args.max_new_tokens, seed=args.seed)
        job = CaptionJob(args.prompt, params, args.thinking, args.fps, args.max_frames)
        with tqdm(total=len(todo), unit="video", dynamic_ncols=True, smoothing=0.1) as bar:
            errors = run(pipeline, todo, store, job, batch_size=args.batch_size, workers=args.workers, progress=bar)
    print(f"done: {len(todo) - errors} captioned, {errors} errors, written to {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
