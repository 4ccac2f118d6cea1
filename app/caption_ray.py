"""Batch video captioning on a Ray cluster: `python -m app.caption --ray INPUT... --out DIR`.

The same inputs, ids, options, records and resume rules as the single-process captioner
(app/caption.py); the work is spread over a Ray Data pipeline:

1. the driver expands the inputs (`caption_inputs.expand_inputs`: ids are absolute paths or URLs),
   reads the output folder (`caption_parts.PartsFolder`) and keeps the ids still to caption
   (`caption_store.pending`: captioned ones never again, error-only ones with `--retry-errors`);
2. `ray.data.from_items` cuts them into blocks of `--videos-per-task` ids;
3. `map_batches` runs `CaptionActor` on a pool of `--actors` actors, each holding one `mm.Pipeline`
   (its serving engine) and running `caption_run.run` on a block: decoding threads ahead of the
   engine, per-video errors as error records. Each actor takes two blocks at once, so that the
   next block's videos fill the engine's slots while the last captions of the previous one finish;
4. `write_datasink(PartsSink)` writes each block as one part file (JSON Lines or Parquet).

Exactly once: an actor returns a block's records only when the whole block is captioned, so a
killed or crashed actor loses nothing that was written; Ray Data restarts it and runs the block
again (its defaults for actor pools: restarts and retries without limit). A block is written once:
its part's name is the run's start time and a digest of its ids, written under a temporary name
and moved into place, and skipped when that name already exists. Readers take one record per id
anyway (`caption_store.final_records`: the first caption, else the last error), which also covers
two runs on one folder at once.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from typing import Any

import pyarrow as pa
import ray
from ray.data import ActorPoolStrategy
from tqdm import tqdm

from .caption import checked, plan_line
from .caption_parts import RECORD_SCHEMA, PartsFolder, PartsSink, json_text
from .caption_run import load_job, run
from .caption_store import pending

CONCURRENT_BLOCKS = 2  # blocks one actor captions at once, sharing its engine


class CaptionActor:
    """One actor of the pool: one pipeline and its engine, loaded once; called once per block."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.pipeline, self.job = load_job(args, args.model)  # None: the built-in model, made on this node

    def __call__(self, batch: pa.Table) -> pa.Table:
        records = Records()
        run(self.pipeline, batch.column("path").to_pylist(), records, self.job, batch_size=self.args.batch_size,
            workers=self.args.workers, progress=tqdm(disable=True))  # fmt: skip
        if self.args.json_schema is not None:  # --json-schema captions are objects: carried as their JSON text
            records = [dict(r, caption=json_text(r["caption"])) if r["error"] is None else r for r in records]
        return pa.Table.from_pylist(records, schema=RECORD_SCHEMA)


class Records(list):
    """A block's records, as `run` writes them."""

    def write(self, record: dict[str, Any]) -> None:
        self.append(record)


def main(args: argparse.Namespace, paths: list[str]) -> int:
    """Caption `paths` (this shard's ids) on the cluster into the folder `args.out`; 0 when done."""
    start = time.perf_counter()
    folder = checked(lambda: PartsFolder(args.out))
    state = checked(folder.state)
    todo = pending(paths, state, args.retry_errors)
    print(plan_line(paths, state, args, len(todo)), file=sys.stderr)
    if not todo:
        return 0
    checked(folder.make)
    started = not ray.is_initialized()
    if started:
        checked(lambda: ray.init(address=args.ray_address))
    try:
        sink = caption(args, todo, folder, actors=checked(lambda: args.actors or fitting_actors(args)))
    finally:
        if started:
            ray.shutdown()
    print(summary(sink, len(paths) - len(todo), time.perf_counter() - start, args.out), file=sys.stderr)
    return 0


def caption(args: argparse.Namespace, todo: list[str], folder: PartsFolder, *, actors: int) -> PartsSink:
    """Run the Ray Data pipeline over `todo` on the connected cluster; returns the sink with its counts."""
    run_id = time.strftime("%Y%m%dT%H%M%S", time.gmtime()) + f"{time.time_ns() // 1000 % 1_000_000:06d}Z"
    per_task = args.videos_per_task or block_size(len(todo), args.batch_size, actors)
    blocks = math.ceil(len(todo) / per_task)
    data = ray.data.from_items([{"path": p} for p in todo], override_num_blocks=blocks)
    pool = ActorPoolStrategy(size=min(actors, blocks), max_tasks_in_flight_per_actor=CONCURRENT_BLOCKS,
                             max_concurrent_calls_per_actor=CONCURRENT_BLOCKS, enable_true_multi_threading=True)
    data = data.map_batches(CaptionActor, fn_constructor_args=(args,), batch_size=per_task, batch_format="pyarrow",
                            compute=pool, num_cpus=args.cpus_per_actor, num_gpus=args.gpus_per_actor or None)
    sink = PartsSink(folder, args.format, run_id, json_captions=args.json_schema is not None)
    data.write_datasink(sink, ray_remote_args={"num_cpus": 0})  # I/O only: never waits for a core the actors hold
    return sink


def block_size(videos: int, batch_size: int, actors: int) -> int:
    """Videos per block (map task and part file): 4 x `batch_size`, fewer for a small run so that
    every actor gets two blocks, but never fewer than `batch_size` (the videos in the engine at once)."""
    return max(batch_size, min(4 * batch_size, math.ceil(videos / (CONCURRENT_BLOCKS * actors))))


def fitting_actors(args: argparse.Namespace) -> int:
    """How many actors the cluster holds: its GPUs over --gpus-per-actor, else its CPUs over --cpus-per-actor."""
    resources = ray.cluster_resources()
    if args.gpus_per_actor:
        count, what = int(resources.get("GPU", 0) // args.gpus_per_actor), "GPUs"
    else:
        count, what = int(resources.get("CPU", 0) // args.cpus_per_actor), "CPUs"
    if count < 1:
        raise RuntimeError(f"the Ray cluster has {resources.get(what[:-1], 0):g} {what}: not enough for one actor "
                           f"of --cpus-per-actor {args.cpus_per_actor:g} --gpus-per-actor {args.gpus_per_actor:g}")
    return count


def summary(sink: PartsSink, skipped: int, seconds: float, out: str) -> str:
    """The closing line: done, errors, skipped and videos per hour (over the whole run, Ray's start-up included)."""
    done = sink.captioned + sink.errors
    return (f"done: {sink.captioned} captioned, {sink.errors} errors, {skipped} skipped, written to {out}; "
            f"{done / seconds * 3600:.0f} videos/hour ({seconds:.1f} s with Ray's start-up)")
