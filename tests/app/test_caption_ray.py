"""python -m app.caption --ray: the Ray Data captioner on a local 2-CPU cluster, and its output folder.

The cluster tests share one `ray.init(num_cpus=2)` for the module; they are marked `ray`, `slow` and
`subprocess` (a Ray cluster is processes), so `make test` runs them and `make test-fast` does not.
Ray is a dev dependency: without it this module fails to import instead of skipping.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import ray

from app import caption
from app.caption_parts import RECORD_SCHEMA, PartsFolder, part_name
from tests.app.conftest import write_videos
from tests.app.test_caption import FAST, read_records, retry_inputs
from tests.app.test_caption_schema import SCHEMA, VIDEO

REPO = Path(__file__).resolve().parents[2]
ACTOR_TITLE = "MapBatches(CaptionActor)"  # in the process title of the pool's actors


def on_cluster(test):
    """Marks a test that runs on the module's local Ray cluster."""
    for mark in (pytest.mark.ray, pytest.mark.slow, pytest.mark.subprocess, pytest.mark.usefixtures("cluster")):
        test = mark(test)
    return test


@pytest.fixture(scope="module")
def cluster():
    ray.init(num_cpus=2, include_dashboard=False)
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()


def part_records(out: Path) -> list[dict]:
    """Every record of every part, duplicates included."""
    return PartsFolder(str(out)).records()


def strip_seconds(records: list[dict]) -> dict[str, dict]:
    return {r["path"]: {k: v for k, v in r.items() if k != "seconds"} for r in records}


# --- without a cluster -------------------------------------------------------------------------


def test_ray_options_are_checked_first(tmp_path, monkeypatch, capsys):
    out = str(tmp_path / "out")
    for options, message in ((["--actors", "2"], "--actors needs --ray"),
                             (["--actors", "2", "--format", "parquet"], "--actors, --format need --ray"),
                             (["--ray", "--actors", "0"], "--actors must be >= 1, got 0"),
                             (["--ray", "--device", "cuda:1"], "use --device cuda")):  # fmt: skip
        with pytest.raises(SystemExit) as exit:
            caption.main([str(tmp_path), "--out", out, *options])
        assert exit.value.code == 2 and message in capsys.readouterr().err
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "ray" else real(name, *a))
    with pytest.raises(SystemExit):
        caption.main([str(tmp_path), "--out", out, "--ray"])
    assert "--ray needs Ray Data, which is not installed: pip install -e '.[ray]'" in capsys.readouterr().err
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="is a file; with --ray, --out is a folder"):
        PartsFolder(str(tmp_path / "file"))


@pytest.mark.parametrize("format", ["jsonl", "parquet"])
def test_parts_are_written_once_and_read_one_record_per_video(tmp_path, format):
    folder = PartsFolder(str(tmp_path / "out"))
    assert folder.records() == [] and folder.state().captioned == set()  # a folder not made yet is empty
    folder.make()
    ok = dict(path="/v/a.mp4", caption="a", thinking="", frames=4, timestamps=[0.0, 0.5, 1.0, 1.5], duration=2.0,
              error=None, finish_reason="length", completion_tokens=3, seconds=0.25)  # fmt: skip
    failed = {key: None for key in ok} | dict(path="/v/b.mp4", error="VideoError: broken", seconds=0.01)
    first = part_name("20260101T000000000000Z", ["/v/b.mp4", "/v/a.mp4"], format)
    assert first == part_name("20260101T000000000000Z", ["/v/a.mp4", "/v/b.mp4"], format)  # order-free
    assert folder.write(first, [ok, failed])
    assert not folder.write(first, [ok | {"caption": "again"}])  # a retried write of the block: kept as it was
    retry = failed | {"error": None, "caption": "b", "frames": 2, "timestamps": [0.0, 0.5], "duration": 1.0}
    assert folder.write(part_name("20260102T000000000000Z", ["/v/b.mp4"], format), [retry])
    (tmp_path / "out" / ".part-half-written.tmp").write_text("{")  # a temporary of an interrupted write
    assert folder.records() == [ok, failed, retry]  # by run, then as written; values round-trip exactly
    assert folder.captions() == [ok, retry]
    assert folder.state().captioned == {"/v/a.mp4", "/v/b.mp4"} and folder.state().failed == set()
    if format == "parquet":
        assert pq.read_schema(tmp_path / "out" / first).remove_metadata() == RECORD_SCHEMA


# --- on the cluster ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """6 videos and a corrupt .mp4."""
    root = tmp_path_factory.mktemp("ray_videos")
    write_videos(root, 6)
    (root / "corrupt.mp4").write_bytes(b"\x00\x00\x00\x18ftypmp42 but then garbage " * 20)
    return root


@on_cluster
def test_ray_output_equals_the_single_process_captioner(folder, tmp_path, capsys):
    options = [str(folder), "--seed", "0", "--batch-size", "2", *FAST]
    assert caption.main([*options, "--out", str(tmp_path / "single.jsonl")]) == 0
    out = tmp_path / "parts"
    assert caption.main([*options, "--out", str(out), "--ray", "--actors", "2", "--format", "parquet"]) == 0
    err = capsys.readouterr().err
    assert "done: 6 captioned, 1 errors, 0 skipped" in err and "videos/hour" in err
    single, parts = read_records(tmp_path / "single.jsonl"), part_records(out)
    assert len(parts) == 7 and strip_seconds(parts) == strip_seconds(single)
    [error] = [r for r in parts if r["error"] is not None]
    assert Path(error["path"]).name == "corrupt.mp4" and "corrupt.mp4" in error["error"]
    assert all(name.endswith(".parquet") for name in os.listdir(out))
    assert caption.main([*options, "--out", str(out), "--ray"]) == 0  # all done: Ray is not even started
    assert "6 already captioned in" in capsys.readouterr().err


@on_cluster
def test_json_schema_captions_on_ray_equal_the_single_process_ones(folder, tmp_path):
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps(SCHEMA))
    options = [str(folder), "--json-schema", str(schema), *VIDEO, "--max-new-tokens", "160", "--batch-size", "2"]
    assert caption.main([*options, "--out", str(tmp_path / "single.jsonl")]) == 0
    for format in ("jsonl", "parquet"):
        out = tmp_path / format
        assert caption.main([*options, "--out", str(out), "--ray", "--actors", "2", "--format", format]) == 0
        single, parts = strip_seconds(read_records(tmp_path / "single.jsonl")), strip_seconds(part_records(out))
        if format == "parquet":  # Parquet's caption column holds the objects' JSON text
            parts = {p: dict(r, caption=r["caption"] and json.loads(r["caption"])) for p, r in parts.items()}
        assert parts == single and sum(isinstance(r["caption"], dict) for r in single.values()) == 6


def actor_pids() -> list[int]:
    """The pool actors' processes of this test's cluster (descendants of this process)."""
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            title = (entry / "cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if entry.name.isdigit() and ACTOR_TITLE in title and os.getpid() in ancestors(int(entry.name)):
            pids.append(int(entry.name))
    return pids


def ancestors(pid: int) -> list[int]:
    found = []
    while pid > 1:
        try:
            pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            break
        found.append(pid)
    return found


def wait_for_parts(out: Path, at_least: int, alive, timeout: float = 120) -> int:
    deadline = time.monotonic() + timeout
    while True:
        count = len([n for n in os.listdir(out) if n.startswith("part-")]) if out.exists() else 0
        if count >= at_least:
            return count
        assert alive(), "the run ended before it could be interrupted"
        assert time.monotonic() < deadline, f"no {at_least} part files after {timeout} s"
        time.sleep(0.05)


@on_cluster
def test_an_actor_killed_mid_run_is_restarted_and_each_video_captioned_once(tmp_path):
    videos = write_videos(tmp_path / "videos", 8)
    out = tmp_path / "parts"
    command = [str(tmp_path / "videos"), "--out", str(out), "--ray", "--actors", "1", "--videos-per-task", "2",
               "--batch-size", "2", "--max-new-tokens", "24", "--fps", "4", "--max-frames", "8"]  # fmt: skip
    result, earlier = {}, set(actor_pids())  # (an earlier test's actors may still be on their way out)
    runner = threading.Thread(target=lambda: result.setdefault("status", caption.main(command)))
    runner.start()
    written = wait_for_parts(out, 1, runner.is_alive)
    [pid] = set(actor_pids()) - earlier
    os.kill(pid, signal.SIGKILL)  # the actor dies as in an OOM kill or a crash
    assert written < 4, "the kill came too late to interrupt the run"
    runner.join(timeout=240)
    assert not runner.is_alive() and result["status"] == 0
    records = part_records(out)
    assert sorted(r["path"] for r in records) == sorted(map(str, videos))  # each exactly once, none lost
    assert all(r["error"] is None for r in records)
    assert pid not in actor_pids()


@on_cluster
def test_resume_after_the_run_was_killed(cluster, tmp_path, capsys):
    videos = write_videos(tmp_path / "videos", 10)
    out = tmp_path / "parts"
    command = [sys.executable, "-m", "app.caption", str(tmp_path / "videos"), "--out", str(out), "--ray",
               "--ray-address", cluster, "--actors", "1", "--videos-per-task", "2", "--batch-size", "2",
               "--max-new-tokens", "24", "--fps", "4", "--max-frames", "8"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    process = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for_parts(out, 1, lambda: process.poll() is None, timeout=180)
        process.send_signal(signal.SIGKILL)  # the driver dies: Ray ends its job's actors
        process.wait(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
    before = {name: (out / name).read_bytes() for name in os.listdir(out) if name.startswith("part-")}
    written = len(part_records(out))
    assert 2 <= written < len(videos), "the kill came too late to test resuming"

    assert caption.main(command[3:]) == 0  # the same command, in this process
    assert f"{written} already captioned in" in capsys.readouterr().err
    records = part_records(out)
    assert sorted(r["path"] for r in records) == sorted(map(str, videos))  # each exactly once
    assert all((out / name).read_bytes() == data for name, data in before.items())  # earlier parts untouched


@on_cluster
def test_ray_retry_errors_redoes_only_failed_videos(tmp_path, capsys):
    _, late, corrupt, listing = retry_inputs(tmp_path)
    out = tmp_path / "parts"
    command = [str(listing), "--out", str(out), "--ray", "--actors", "1", *FAST]
    assert caption.main(command) == 0
    first = part_records(out)
    assert sorted(Path(r["path"]).name for r in first if r["error"]) == ["corrupt.mp4", "late.mp4"]
    assert "done: 2 captioned, 2 errors, 0 skipped" in capsys.readouterr().err

    write_videos(tmp_path / "late", 1)[0].rename(late)  # the missing video arrives
    assert caption.main(command) == 0  # without --retry-errors, errors stay as they are
    assert "2 with error records (skipped; --retry-errors retries them), 0 to caption" in capsys.readouterr().err

    assert caption.main([*command, "--retry-errors"]) == 0
    assert "done: 1 captioned, 1 errors, 2 skipped" in capsys.readouterr().err
    records = part_records(out)
    assert records[: len(first)] == first  # the first run's parts are kept; a retry adds a part
    captions = PartsFolder(str(out)).captions()  # one record per video
    assert sorted(Path(r["path"]).name for r in captions if r["error"] is None) == ["clip00.mp4", "clip01.mp4",
                                                                                     "late.mp4"]  # fmt: skip
    assert [r["error"] is not None for r in records if r["path"] == str(corrupt)] == [True, True]
