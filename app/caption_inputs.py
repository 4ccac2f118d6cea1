"""Inputs of the captioner: video files, folders, globs, URLs and list files expanded to ids, and sharding."""

from __future__ import annotations

import csv
import glob
import hashlib
import json
import os
from pathlib import Path

from .media import is_video

LIST_SUFFIXES = (".txt", ".csv", ".jsonl", ".parquet")
URL_SCHEMES = ("http://", "https://", "rtsp://")  # read by FFmpeg itself (preprocess/video_index.py)


def expand_inputs(inputs: list[str]) -> list[str]:
    """The ids of the videos named by `inputs`, sorted, without duplicates: absolute paths, and URLs
    as written. The id is the record's "path", stable across runs (resume and shards use it).

    An input is a video file (any extension), a URL (http, https, rtsp), a folder (searched
    recursively for video extensions, see `app.media.VIDEO_EXTENSIONS`), a glob (`videos/**/*.mp4`,
    quoted so that the shell leaves it; the files it matches with video extensions), or a list file: `.txt`
    (one path or URL a line; blank lines and `#` comments skipped), `.csv` (a `path` column, else
    the first column), `.jsonl` (objects with a "path", e.g. an earlier captions file, or JSON
    strings) or `.parquet` (a `path` column, else the first column; needs pyarrow). Relative paths
    in a list file are relative to the list file's folder; listed files are not checked here (a
    missing one gets an error record). A missing input, a glob without matches, or a folder without
    videos, is an error.
    """
    found: set[str] = set()
    for item in inputs:
        path = Path(item).expanduser()
        if item.startswith(URL_SCHEMES):
            found.add(item)
        elif not path.exists() and glob.has_magic(item):
            videos = [m for m in glob.glob(str(path), recursive=True) if os.path.isfile(m) and is_video(m)]
            if not videos:
                raise FileNotFoundError(f"no video files match {item}")
            found.update(os.path.abspath(m) for m in videos)
        elif path.is_dir():
            videos = [p for p in path.rglob("*") if p.is_file() and is_video(p)]
            if not videos:
                raise FileNotFoundError(f"no video files under {path}")
            found.update(os.path.abspath(p) for p in videos)
        elif path.is_file() and path.suffix.lower() in LIST_SUFFIXES:
            found.update(_resolve(entry, path.parent) for entry in read_list(path))
        elif path.is_file():
            found.add(os.path.abspath(path))
        else:
            raise FileNotFoundError(f"input not found: {item}")
    return sorted(found)


def _resolve(entry: str, folder: Path) -> str:
    """A list file's entry as an id: a URL as it is, a path made absolute from the list's folder."""
    return entry if entry.startswith(URL_SCHEMES) else os.path.abspath(folder / entry)


def read_list(path: Path) -> list[str]:
    """The paths named by a .txt, .csv, .jsonl or .parquet list file."""
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        return _parquet_paths(path)
    text = path.read_text(encoding="utf-8")
    if suffix == ".txt":
        lines = (line.strip() for line in text.splitlines())
        return [line for line in lines if line and not line.startswith("#")]
    if suffix == ".csv":
        rows = [row for row in csv.reader(text.splitlines()) if row and row[0].strip()]
        column = rows[0].index("path") if rows and "path" in rows[0] else None
        if column is None:
            return [row[0].strip() for row in rows]
        return [row[column].strip() for row in rows[1:] if len(row) > column and row[column].strip()]
    return [_jsonl_path(line, path, n) for n, line in enumerate(text.splitlines(), 1) if line.strip()]


def _jsonl_path(line: str, path: Path, number: int) -> str:
    try:
        value = json.loads(line)
    except json.JSONDecodeError as error:
        raise ValueError(f"{path}, line {number}: not JSON ({error})") from error
    if isinstance(value, dict) and isinstance(value.get("path"), str):
        return value["path"]
    if isinstance(value, str):
        return value
    raise ValueError(f"{path}, line {number}: expected an object with a string 'path', or a string")


def _parquet_paths(path: Path) -> list[str]:
    try:
        import pyarrow.parquet as pq
    except ModuleNotFoundError:
        raise ValueError(f"{path}: reading a .parquet list needs pyarrow: pip install -e '.[ray]' "
                         "(or pip install pyarrow)") from None
    schema = pq.read_schema(path)
    column = "path" if "path" in schema.names else schema.names[0] if schema.names else None
    if column is None:
        raise ValueError(f"{path}: a .parquet list needs a column of paths (named 'path', or the first)")
    values = pq.read_table(path, columns=[column]).column(column).to_pylist()
    if not all(isinstance(value, str) for value in values):
        raise ValueError(f"{path}: column {column!r} must hold strings (paths or URLs), without nulls")
    return [value.strip() for value in values if value.strip()]


def parse_shard(text: str) -> tuple[int, int]:
    """"i/n" -> (i, n) with 0 <= i < n."""
    try:
        index, count = (int(part) for part in text.split("/"))
    except ValueError:
        raise ValueError(f"--shard takes i/n (e.g. 0/4), got {text!r}") from None
    if count < 1 or not 0 <= index < count:
        raise ValueError(f"--shard {text}: need 0 <= i < n")
    return index, count


def in_shard(path: str, index: int, count: int) -> bool:
    """Whether `path` belongs to shard `index` of `count`: by a hash of the absolute path, so that a
    video's shard does not depend on which other files exist or on the order they were listed."""
    digest = hashlib.sha1(path.encode("utf-8", "surrogateescape")).digest()
    return int.from_bytes(digest[:8], "big") % count == index


def read_schema(path: str) -> dict:
    """The JSON schema in file `path` (for --json-schema), checked against its meta-schema; a
    ValueError naming the file and the problem otherwise."""
    import jsonschema

    try:
        schema = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"--json-schema {path}: {error}") from None
    if not isinstance(schema, dict):
        raise ValueError(f"--json-schema {path}: a schema is a JSON object, got {type(schema).__name__}")
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as error:
        raise ValueError(f"--json-schema {path}: not a valid JSON schema: {error.message}") from None
    return schema
