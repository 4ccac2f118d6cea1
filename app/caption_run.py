"""The captioning loop: decode videos ahead on a thread pool, caption them in the engine, write records.

Up to `batch_size` videos are in the engine at once; as soon as one caption ends, its record is
written and the next decoded video starts (the engine's continuous batching), so the batch stays
full instead of waiting for the slowest caption of a fixed group.

Threads, not processes, decode: PyAV releases the GIL while it demuxes, decodes and converts frames,
so threads decode in parallel with each other and with generation (torch also releases the GIL),
and a decoded clip (uint8 frames, often hundreds of MB) reaches the generation thread without
being pickled and copied between processes.
"""

from __future__ import annotations

import argparse
import functools
import json
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import preprocess
from lm import SamplingParams
from mm import Pipeline
from mm.pipeline import Answer

from .loading import load_pipeline, pipeline_options


class RecordSink(Protocol):
    """Where `run` puts each video's record: the JSONL store, or an actor's list of a batch's records."""

    def write(self, record: dict[str, Any]) -> None: ...


@dataclass
class Decoded:
    """One video's sampled frames, or why there are none."""

    path: str
    clip: preprocess.VideoClip | None
    error: str | None
    seconds: float


@dataclass(frozen=True)
class CaptionJob:
    """What to ask about every video, and how."""

    prompt: str
    params: SamplingParams
    enable_thinking: bool
    fps: float
    max_frames: int


def load_job(args: argparse.Namespace, model: str | Path | None) -> tuple[Pipeline, CaptionJob]:
    """The pipeline of `model` (a checkpoint directory, or None for the built-in model) with the
    engine options, and the job, of the captioner's command line (`python -m app.caption`'s arguments)."""
    pipeline = load_pipeline(model, **pipeline_options(args))
    params = pipeline.default_params(args.preset, max_new_tokens=args.max_new_tokens, seed=args.seed,
                                     json_schema=args.json_schema, thinking_budget=args.thinking_budget)  # fmt: skip
    pipeline.constraint_rule(params, args.thinking)  # an unsupported schema fails here, not once per video
    return pipeline, CaptionJob(args.prompt, params, args.thinking, args.fps, args.max_frames)


def decode(path: str, fps: float, max_frames: int) -> Decoded:
    """Sample one video's frames; a missing, empty, corrupt or unreadable file gives an error instead."""
    start = time.perf_counter()
    try:
        clip = preprocess.sample_video(path, fps=fps, max_frames=max_frames)
    except (ValueError, OSError) as error:  # preprocess.VideoError is a ValueError
        return Decoded(path, None, f"{type(error).__name__}: {error}", time.perf_counter() - start)
    return Decoded(path, clip, None, time.perf_counter() - start)


def prefetch(paths: Iterable[str], work: Callable[[str], Decoded], workers: int, ahead: int) -> Iterator[Decoded]:
    """`work(path)` for every path, in order, computed by `workers` threads up to `ahead` paths early."""
    pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="decode")
    pending: deque[Future] = deque()
    paths = iter(paths)
    try:
        for path in paths:
            pending.append(pool.submit(work, path))
            if len(pending) >= ahead:
                break
        while pending:
            result = pending.popleft().result()
            for path in paths:  # top up by one
                pending.append(pool.submit(work, path))
                break
            yield result
    finally:
        pool.shutdown(wait=False, cancel_futures=True)


def conversation(item: Decoded, job: CaptionJob) -> list[dict[str, Any]]:
    return [{"role": "user", "content": [{"type": "video", "video": item.clip}, {"type": "text", "text": job.prompt}]}]


def caption_record(item: Decoded, caption: Any, thinking: str, finish_reason: str, tokens: int,
                   seconds: float) -> dict[str, Any]:  # fmt: skip
    clip = item.clip
    return dict(path=item.path, caption=caption, thinking=thinking, frames=len(clip),
                timestamps=[round(float(t), 3) for t in clip.timestamps], duration=round(float(clip.duration), 3),
                error=None, finish_reason=finish_reason, completion_tokens=tokens,
                seconds=round(seconds, 3))  # fmt: skip


def parsed_caption(text: str, schema: str) -> Any:
    """The caption `text` parsed as JSON and validated against `schema` (JSON text); a ValueError
    saying why not (the grammar only fails this when generation was cut, e.g. by max_new_tokens)."""
    import jsonschema

    try:
        value = json.loads(text)
        schema_validator(schema).validate(value)
    except json.JSONDecodeError as error:
        raise ValueError(f"the caption is not complete JSON for --json-schema: {error}") from None
    except jsonschema.ValidationError as error:
        raise ValueError(f"the caption does not follow --json-schema: {error.message}") from None
    return value


@functools.cache
def schema_validator(schema: str):
    """The jsonschema validator of `schema` (JSON text), made once for every caption of a run."""
    import jsonschema

    parsed = json.loads(schema)
    return jsonschema.validators.validator_for(parsed)(parsed)


def error_record(item: Decoded, error: str) -> dict[str, Any]:
    return dict(path=item.path, caption=None, thinking=None, frames=None, timestamps=None, duration=None, error=error,
                finish_reason=None, completion_tokens=None, seconds=round(item.seconds, 3))  # fmt: skip


def run(pipeline: Pipeline, paths: list[str], store: RecordSink, job: CaptionJob, *, batch_size: int,
        workers: int, progress: Any) -> int:  # fmt: skip
    """Caption `paths` into `store` with up to `batch_size` videos generating at once; returns the
    number of errors. `progress` is a tqdm-like bar (`update(n)`, `set_postfix`)."""
    errors = 0
    in_flight: list[tuple[Decoded, Answer]] = []

    def emit(record: dict[str, Any]) -> None:
        nonlocal errors
        store.write(record)
        errors += record["error"] is not None
        progress.update(1)
        progress.set_postfix(errors=errors, refresh=False)

    def finish(item: Decoded, answer: Answer) -> None:
        try:
            output = answer.output()
        except (ValueError, RuntimeError) as error:  # e.g. the vision tower refused the frames
            return emit(error_record(item, f"{type(error).__name__}: {error}"))
        caption = output.text
        if job.params.json_schema is not None:
            try:
                caption = parsed_caption(output.text, job.params.json_schema)
            except ValueError as error:
                return emit(error_record(item, f"{error} (finish_reason {output.finish_reason})"))
        emit(caption_record(item, caption, output.thinking, output.finish_reason, output.completion_tokens,
                            item.seconds + output.timings["total"]))  # fmt: skip

    def drain(below: int) -> None:
        """Write the finished captions until fewer than `below` are in flight."""
        while len(in_flight) >= below:
            done = [pair for pair in in_flight if pair[1].request.done]
            if not done:
                time.sleep(0.005)
                continue
            for pair in done:
                in_flight.remove(pair)
                finish(*pair)

    work = lambda path: decode(path, job.fps, job.max_frames)  # noqa: E731
    try:
        for item in prefetch(paths, work, workers, ahead=workers + batch_size):
            if item.error is not None:
                emit(error_record(item, item.error))
                continue
            try:
                answer = pipeline.submit(conversation(item, job), job.params, enable_thinking=job.enable_thinking)
            except ValueError as error:  # e.g. a prompt too long for the context: this video only
                emit(error_record(item, f"{type(error).__name__}: {error}"))
                continue
            in_flight.append((item, answer))
            drain(below=batch_size)
        drain(below=1)
    finally:
        for _, answer in in_flight:  # interrupted: stop what is still generating
            answer.cancel()
    return errors
