"""The captioner's output: a JSON Lines file, appended one fsync'ed record at a time, resumable."""

from __future__ import annotations

import fcntl
import json
import os
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any


def parse_record(line: str, where: str) -> dict[str, Any]:
    """One JSON line of a captions file; ValueError naming `where` (file and line) if it is not a record."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as error:
        raise ValueError(f"{where}: not a JSON record ({error}); is this a captions file?") from None
    if not isinstance(record, dict) or not isinstance(record.get("path"), str):
        raise ValueError(f"{where}: a record needs a string 'path'; is this a captions file?")
    return record


def record_states(records: Iterable[dict[str, Any]]) -> tuple[set[str], set[str]]:
    """(captioned, failed): the paths with a record whose "error" is null, and those whose records are all errors."""
    records = list(records)
    done = {record["path"] for record in records}
    captioned = {record["path"] for record in records if record.get("error") is None}
    return captioned, done - captioned


def final_records(records: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """One record per path, in order of first appearance: its first caption, or, when it has none,
    its last error record (a retry appends a new one)."""
    chosen: dict[str, dict[str, Any]] = {}
    for record in records:
        kept = chosen.get(record["path"])
        if kept is None or (kept.get("error") is not None):
            chosen[record["path"]] = record
    return list(chosen.values())


def pending(paths: Iterable[str], store: Any, retry_errors: bool) -> list[str]:
    """The paths still to caption: without a caption in `store` (anything with `captioned` and
    `failed` sets), and, unless `retry_errors`, without an error record either."""
    return [p for p in paths if p not in store.captioned and (retry_errors or p not in store.failed)]


class CaptionStore:
    """Appends records to a .jsonl file; knows which paths already have a caption and which only errors.

    `captioned`: paths with a record whose "error" is null (never captioned again); `failed`: paths
    whose records are all errors (retried only on request, each retry appending a new record, so
    a path's last record is its current state); `done`: every path with a record.

    Each record is written as one line with a single `write`, then flushed and fsync'ed, so after
    a crash or SIGKILL every line but possibly the last is whole. Opening repairs that: a last line
    without its newline (a torn write) is cut off, with a note on stderr. Any other line that is
    not a JSON object with a "path" means the file is not ours: ValueError naming the line. The file
    is locked (flock) while open, so a second captioner on the same output fails instead of interleaving.
    A file this store made and never wrote to (a run refused before its first video) is removed on close,
    unless `finish()` said the run completed (a shard with nothing to caption keeps its empty file).
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._created, self._locked = not self.path.exists(), False
        self._file = open(self.path, "a", encoding="utf-8")
        try:
            self._lock()
            self.captioned, self.failed = record_states(self._read_and_repair())
            self.done: set[str] = self.captioned | self.failed
        except BaseException:
            self.close()
            raise

    def write(self, record: dict[str, Any]) -> None:
        """Append one record (must have "path") durably."""
        line = json.dumps(record, ensure_ascii=False) + "\n"
        self._file.write(line)
        self._file.flush()
        os.fsync(self._file.fileno())
        self.done.add(record["path"])
        if record.get("error") is None:
            self.captioned.add(record["path"])
            self.failed.discard(record["path"])
        elif record["path"] not in self.captioned:
            self.failed.add(record["path"])

    def finish(self) -> None:
        """The run completed: keep the file on close even when it is empty (its shard had no videos)."""
        self._created = False

    def close(self) -> None:
        if self._created and self._locked and not self._file.closed and self._file.tell() == 0:
            self.path.unlink(missing_ok=True)  # (still locked: no other captioner has it)
        self._file.close()

    def __enter__(self) -> "CaptionStore":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _lock(self) -> None:
        try:
            fcntl.flock(self._file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise RuntimeError(f"{self.path} is being written by another captioner; give each process (shard) "
                               "its own --out file") from None
        self._locked = True

    def _read_and_repair(self) -> list[dict[str, Any]]:
        data = self.path.read_bytes()
        whole = data[: data.rfind(b"\n") + 1]  # every line that has its newline
        if len(whole) < len(data):
            torn = data[len(whole) :]
            print(f"{self.path}: dropping a torn last line ({len(torn)} bytes) left by an interrupted run",
                  file=sys.stderr)  # fmt: skip
            with open(self.path, "r+b") as file:
                file.truncate(len(whole))
                os.fsync(file.fileno())
        lines = whole.decode("utf-8").splitlines()
        return [parse_record(line, f"{self.path}, line {n}") for n, line in enumerate(lines, 1) if line.strip()]
