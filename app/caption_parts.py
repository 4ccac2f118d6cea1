"""The cluster captioner's output: a folder of part files, each written once, read back one record per video.

This module imports no model code (it is what Ray's write tasks load).

`--out` is a local or shared folder (NFS, Lustre: the same path on every node) or an object-store
URI that pyarrow opens (`s3://bucket/captions`, `gs://...`). Each part file holds the records of
one written block, as JSON Lines (the single-process captioner's lines) or Parquet (`RECORD_SCHEMA`,
the same fields). Its name, `part-<run>-<digest>.<ext>`, is the run's start time (so names sort by
run) and a digest of the block's sorted ids: a retried write of the same block in the same run
finds its name taken and writes nothing. A part is written under a temporary dot-name and then
moved into place, so a reader never sees half a part; readers ignore dot-names.
"""

from __future__ import annotations

import hashlib
import json
import os
import uuid
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
from ray.data.block import BlockAccessor
from ray.data.datasource import Datasink, WriteResult

from .caption_store import final_records, parse_record, record_states

FORMATS = {"jsonl": ".jsonl", "parquet": ".parquet"}
RECORD_SCHEMA = pa.schema([  # the fields of app.caption_run's caption_record and error_record, in their order
    ("path", pa.string()), ("caption", pa.string()), ("thinking", pa.string()), ("frames", pa.int64()),
    ("timestamps", pa.list_(pa.float64())), ("duration", pa.float64()), ("error", pa.string()),
    ("finish_reason", pa.string()), ("completion_tokens", pa.int64()), ("seconds", pa.float64()),
])  # fmt: skip


def json_text(value: Any) -> str:
    """A --json-schema caption as compact JSON text (how Arrow blocks and Parquet parts carry it)."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def part_name(run: str, ids: list[str], format: str) -> str:
    """`part-<run>-<digest>.<ext>`: the digest is of the sorted ids, so a block has one name in a run."""
    digest = hashlib.sha1("\n".join(sorted(ids)).encode("utf-8", "surrogateescape")).hexdigest()[:16]
    return f"part-{run}-{digest}{FORMATS[format]}"


@dataclass(frozen=True)
class ResumeState:
    """What an output folder already holds: `captioned` and `failed` (only error records) paths."""

    captioned: set[str]
    failed: set[str]


class PartsFolder:
    """A folder (or object-store prefix) of part files; picklable, so write tasks carry it."""

    def __init__(self, out: str):
        self.uri = out if "://" in out else os.path.abspath(os.path.expanduser(out))
        self.fs, self.root = pafs.FileSystem.from_uri(self.uri)
        if self.fs.get_file_info(self.root).type == pafs.FileType.File:
            raise ValueError(f"--out {out} is a file; with --ray, --out is a folder (or URI) of part files")

    def make(self) -> None:
        self.fs.create_dir(self.root, recursive=True)

    def names(self) -> list[str]:
        """The part files' names, sorted (by run, then digest)."""
        infos = self.fs.get_file_info(pafs.FileSelector(self.root, allow_not_found=True))
        names = (info.base_name for info in infos if info.type == pafs.FileType.File)
        return sorted(n for n in names if n.startswith("part-") and n.endswith(tuple(FORMATS.values())))

    def read(self, name: str) -> list[dict[str, Any]]:
        """The records of one part file; ValueError naming the file (and line) if it is not ours."""
        path = f"{self.root}/{name}"
        if name.endswith(FORMATS["parquet"]):
            table = pq.read_table(path, filesystem=self.fs)
            if "path" not in table.column_names:
                raise ValueError(f"{self.uri}/{name}: no 'path' column; is this a captions part?")
            return table.to_pylist()
        with self.fs.open_input_stream(path) as stream:
            lines = stream.read().decode("utf-8").splitlines()
        return [parse_record(line, f"{self.uri}/{name}, line {n}") for n, line in enumerate(lines, 1) if line.strip()]

    def records(self) -> list[dict[str, Any]]:
        """Every record of every part, in name order (a video may have several: see `final_records`)."""
        return [record for name in self.names() for record in self.read(name)]

    def captions(self) -> list[dict[str, Any]]:
        """One record per video: its first caption, else its last error (`caption_store.final_records`)."""
        return final_records(self.records())

    def state(self) -> ResumeState:
        return ResumeState(*record_states(self.records()))

    def write(self, name: str, records: list[dict[str, Any]]) -> bool:
        """Write one part, unless a part of that name exists (then False: write-once)."""
        path = f"{self.root}/{name}"
        if self.fs.get_file_info(path).type != pafs.FileType.NotFound:
            return False
        temporary = f"{self.root}/.{name}.{uuid.uuid4().hex}.tmp"
        if name.endswith(FORMATS["parquet"]):
            pq.write_table(pa.Table.from_pylist(records, schema=RECORD_SCHEMA), temporary, filesystem=self.fs)
        else:
            with self.fs.open_output_stream(temporary) as stream:
                stream.write("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records).encode("utf-8"))
        self.fs.move(temporary, path)
        return True


class PartsSink(Datasink):
    """Writes each write task's blocks as one part file of `folder`; counts captions and errors."""

    def __init__(self, folder: PartsFolder, format: str, run_id: str, json_captions: bool = False):
        """`json_captions`: the captions are JSON texts of --json-schema objects, written to JSONL parts as
        the objects (as the single-process captioner does) and to Parquet parts as the texts."""
        self.folder, self.format, self.run_id = folder, format, run_id
        self.json_captions = json_captions and format == "jsonl"
        self.captioned = self.errors = 0

    def write(self, blocks, ctx) -> tuple[int, int]:
        records = [r for block in blocks for r in BlockAccessor.for_block(block).to_arrow().to_pylist()]
        if self.json_captions:
            records = [dict(r, caption=json.loads(r["caption"])) if r["error"] is None else r for r in records]
        if records:
            self.folder.write(part_name(self.run_id, [r["path"] for r in records], self.format), records)
        errors = sum(r["error"] is not None for r in records)
        return len(records) - errors, errors

    def on_write_complete(self, write_result: WriteResult) -> None:  # on the driver
        self.captioned = sum(captioned for captioned, _ in write_result.write_returns)
        self.errors = sum(errors for _, errors in write_result.write_returns)
