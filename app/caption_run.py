"""The captioning loop: decode videos ahead on a thread pool, caption them in batches, write records.

Threads, not processes, decode: PyAV releases the GIL while it demuxes, decodes and converts frames,
so threads decode in parallel with each other and with generation (torch also releases the GIL),
and a decoded clip (uint8 frames, often hundreds of MB) reaches the generation thread without
being pickled and copied between processes.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import preprocess
from lm import SamplingParams
from mm import Pipeline

from .caption_store import CaptionStore


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


def caption_batch(pipeline: Pipeline, batch: list[Decoded], job: CaptionJob) -> list[dict[str, Any]]:
    """Records for a batch of decoded videos, generated together. A batch the pipeline refuses
    (e.g. a prompt too long for the context) is split so that only the offending videos get errors."""
    question = {"type": "text", "text": job.prompt}
    conversations = [[{"role": "user", "content": [{"type": "video", "video": item.clip}, question]}] for item in batch]
    start = time.perf_counter()
    try:
        outputs = pipeline.generate(conversations, job.params, enable_thinking=job.enable_thinking)
    except ValueError as error:
        if len(batch) == 1:
            return [error_record(batch[0], f"{type(error).__name__}: {error}")]
        return [record for item in batch for record in caption_batch(pipeline, [item], job)]
    share = (time.perf_counter() - start) / len(batch)
    return [caption_record(item, output.text, output.thinking, output.finish_reason, output.completion_tokens,
                           item.seconds + share) for item, output in zip(batch, outputs)]  # fmt: skip


def caption_record(item: Decoded, caption: str, thinking: str, finish_reason: str, tokens: int,
                   seconds: float) -> dict[str, Any]:  # fmt: skip
    clip = item.clip
    return dict(path=item.path, caption=caption, thinking=thinking, frames=len(clip),
                timestamps=[round(float(t), 3) for t in clip.timestamps], duration=round(float(clip.duration), 3),
                error=None, finish_reason=finish_reason, completion_tokens=tokens,
                seconds=round(seconds, 3))  # fmt: skip


def error_record(item: Decoded, error: str) -> dict[str, Any]:
    return dict(path=item.path, caption=None, thinking=None, frames=None, timestamps=None, duration=None, error=error,
                finish_reason=None, completion_tokens=None, seconds=round(item.seconds, 3))  # fmt: skip


def run(pipeline: Pipeline, paths: list[str], store: CaptionStore, job: CaptionJob, *, batch_size: int,
        workers: int, progress: Any) -> int:  # fmt: skip
    """Caption `paths` into `store`, `batch_size` videos a generate call; returns the number of errors.
    `progress` is a tqdm-like bar (`update(n)`, `set_postfix`)."""
    errors = 0

    def emit(records: list[dict[str, Any]]) -> None:
        nonlocal errors
        for record in records:
            store.write(record)
            errors += record["error"] is not None
        progress.update(len(records))
        progress.set_postfix(errors=errors, refresh=False)

    batch: list[Decoded] = []
    work = lambda path: decode(path, job.fps, job.max_frames)  # noqa: E731
    for item in prefetch(paths, work, workers, ahead=workers + batch_size):
        if item.error is not None:
            emit([error_record(item, item.error)])
            continue
        batch.append(item)
        if len(batch) == batch_size:
            emit(caption_batch(pipeline, batch, job))
            batch = []
    if batch:
        emit(caption_batch(pipeline, batch, job))
    return errors
