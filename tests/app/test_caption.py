"""python -m app.caption end to end: folders with bad files, SIGKILL and resume, shards, list inputs, the store."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from app import RANDOM_WEIGHTS_NOTICE, caption
from app.caption_inputs import expand_inputs, in_shard, parse_shard
from app.caption_store import CaptionStore
from tests.app.conftest import write_videos

REPO = Path(__file__).resolve().parents[2]
FAST = ["--max-new-tokens", "3", "--fps", "4", "--max-frames", "8"]


def read_records(path: Path) -> list[dict]:
    text = path.read_text(encoding="utf-8")
    assert text.endswith("\n")
    return [json.loads(line) for line in text.splitlines()]  # every line must parse


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """6 videos (3 in a subfolder), a corrupt .mp4, an empty .webm and a non-video file."""
    root = tmp_path_factory.mktemp("videos")
    write_videos(root, 3)
    write_videos(root / "sub", 3, start=3)
    (root / "corrupt.mp4").write_bytes(b"\x00\x00\x00\x18ftypmp42 but then garbage " * 20)
    (root / "empty.webm").write_bytes(b"")
    (root / "notes.txt").write_text("not a video")
    return root


@pytest.mark.slow
def test_folder_with_bad_files_gives_a_record_each(folder, tmp_path, capsys):
    out = tmp_path / "captions.jsonl"
    assert caption.main([str(folder), "--out", str(out), "--batch-size", "4", "--workers", "2", *FAST]) == 0
    assert RANDOM_WEIGHTS_NOTICE in capsys.readouterr().err
    records = read_records(out)
    assert len(records) == 8 and len({r["path"] for r in records}) == 8
    errors = {Path(r["path"]).name: r["error"] for r in records if r["error"] is not None}
    assert sorted(errors) == ["corrupt.mp4", "empty.webm"]
    assert "empty" in errors["empty.webm"] and "corrupt.mp4" in errors["corrupt.mp4"]
    for record in records:
        assert set(record) >= {"path", "caption", "frames", "timestamps", "duration", "error", "seconds"}
        assert Path(record["path"]).is_absolute() and record["seconds"] >= 0
        if record["error"] is None:
            assert isinstance(record["caption"], str) and record["frames"] == len(record["timestamps"]) >= 2
            assert record["frames"] % 2 == 0 and record["duration"] >= 2.0 and record["timestamps"][0] == 0.0
        else:
            assert record["caption"] is None and record["frames"] is None

    assert caption.main([str(folder), "--out", str(out), *FAST]) == 0  # everything is done already
    err = capsys.readouterr().err
    assert "6 already captioned" in err and "2 with error records (skipped; --retry-errors retries them)" in err
    assert len(read_records(out)) == 8


@pytest.mark.slow
def test_shards_cover_every_video_once(folder, tmp_path):
    outs = [tmp_path / f"shard{i}.jsonl" for i in range(2)]
    for i, out in enumerate(outs):
        caption.main([str(folder), "--out", str(out), "--shard", f"{i}/2", "--batch-size", "2", *FAST])
    # each shard holds exactly the videos its hash gives it: one of them may be empty (its file still
    # written), as the split hashes the temporary folder's path too (all 8 land in one shard in ~1 of
    # 128 runs); test_shard_assignment_is_stable_and_complete checks the balance on fixed paths
    shards = [{r["path"] for r in read_records(out)} if out.read_text() else set() for out in outs]
    videos = expand_inputs([str(folder)])
    for i in range(2):
        assert shards[i] == {p for p in videos if in_shard(p, i, 2)}
    assert not shards[0] & shards[1]
    assert shards[0] | shards[1] == set(videos)
    assert len(shards[0] | shards[1]) == 8


def test_a_shard_with_no_videos_still_writes_its_output(tmp_path, capsys):
    (tmp_path / "one.mp4").write_bytes(b"not decoded: its shard is the other one")
    video = expand_inputs([str(tmp_path)])[0]
    other = 1 - next(i for i in range(2) if in_shard(video, i, 2))
    out = tmp_path / "out" / f"shard{other}.jsonl"
    assert caption.main([str(tmp_path / "one.mp4"), "--out", str(out), "--shard", f"{other}/2"]) == 0
    assert "0 videos in shard" in capsys.readouterr().err
    assert out.exists() and out.read_text() == ""  # a completed shard is a file, empty or not


def test_shard_assignment_is_stable_and_complete():
    paths = [f"/data/videos/{i:04d}.mp4" for i in range(200)]
    for count in (1, 3, 8):
        owners = [[i for i in range(count) if in_shard(p, i, count)] for p in paths]
        assert all(len(o) == 1 for o in owners)
        assert len({o[0] for o in owners}) == count  # every shard gets work
    assert parse_shard("2/5") == (2, 5)
    for bad in ("5/5", "-1/2", "1", "a/b", "0/0"):
        with pytest.raises(ValueError, match="shard"):
            parse_shard(bad)


@pytest.mark.subprocess
def test_sigkill_then_resume_captions_each_video_once(tmp_path):
    videos = write_videos(tmp_path / "videos", 12)
    out = tmp_path / "captions.jsonl"
    command = [sys.executable, "-m", "app.caption", str(tmp_path / "videos"), "--out", str(out), "--batch-size", "1",
               "--workers", "1", "--max-new-tokens", "8", "--fps", "4", "--max-frames", "8"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    process = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while not (out.exists() and out.read_text().count("\n") >= 2):
            assert process.poll() is None, "the captioner exited before it could be killed"
            assert time.monotonic() < deadline, "no records after 120 s"
            time.sleep(0.05)
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
    written = read_records(out)
    assert 2 <= len(written) < len(videos), "the kill came too late to test resuming"

    assert caption.main([str(tmp_path / "videos"), "--out", str(out), "--batch-size", "3", *FAST]) == 0
    records = read_records(out)
    assert sorted(r["path"] for r in records) == sorted(str(v) for v in videos)  # each exactly once
    assert records[: len(written)] == written and all(r["error"] is None for r in records)


def test_store_repairs_a_torn_last_line(tmp_path, capsys):
    out = tmp_path / "captions.jsonl"
    good = [{"path": "/a.mp4", "caption": "x"}, {"path": "/b.mp4", "caption": "y"}]
    out.write_text("".join(json.dumps(r) + "\n" for r in good) + '{"path": "/c.mp4", "capt')
    with CaptionStore(out) as store:
        assert store.done == {"/a.mp4", "/b.mp4"}
        store.write({"path": "/c.mp4", "caption": "z"})
    assert "torn last line" in capsys.readouterr().err
    assert read_records(out) == [*good, {"path": "/c.mp4", "caption": "z"}]

    with CaptionStore(out), pytest.raises(RuntimeError, match="another captioner"):
        CaptionStore(out)  # a second writer on the same file

    out.write_text('{"path": "/a.mp4"}\nnot json\n{"path": "/b.mp4"}\n')
    with pytest.raises(ValueError, match="line 2: not a JSON record"):
        CaptionStore(out)


def test_list_files_and_missing_inputs(tmp_path):
    videos = write_videos(tmp_path / "v", 3)
    (tmp_path / "list.txt").write_text(f"# videos\nv/{videos[0].name}\n\n{videos[1]}\n")
    (tmp_path / "list.csv").write_text(f"id,path\n1,v/{videos[1].name}\n2,v/{videos[2].name}\n")
    (tmp_path / "list.jsonl").write_text(json.dumps({"path": f"v/{videos[2].name}", "caption": "old"}) + "\n")
    found = expand_inputs([str(tmp_path / n) for n in ("list.txt", "list.csv", "list.jsonl")] + [str(videos[0])])
    assert found == sorted(str(v) for v in videos)
    with pytest.raises(FileNotFoundError, match="input not found"):
        expand_inputs([str(tmp_path / "nope")])
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no video files under"):
        expand_inputs([str(tmp_path / "empty")])
    with pytest.raises(SystemExit):
        caption.main([str(tmp_path / "v"), "--out", str(tmp_path / "o.jsonl"), "--batch-size", "0"])


def test_globs_urls_and_parquet_lists(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    videos = write_videos(tmp_path / "v", 3)
    (tmp_path / "v" / "notes.txt").write_text("not a video")
    assert expand_inputs([str(tmp_path / "v" / "*")]) == sorted(str(v) for v in videos)  # video extensions only
    assert expand_inputs([str(tmp_path / "**" / "clip0[12].mp4")]) == sorted(str(v) for v in videos[1:])
    with pytest.raises(FileNotFoundError, match="no video files match"):
        expand_inputs([str(tmp_path / "v" / "*.mkv")])
    url = "https://example.com/videos/a.mp4?sig=1"
    (tmp_path / "list.txt").write_text(f"{url}\nv/{videos[0].name}\n")
    pq.write_table(pa.table({"id": [1, 2], "path": [f"v/{videos[1].name}", "rtsp://camera/1"]}), tmp_path / "l.parquet")
    found = expand_inputs([str(tmp_path / "list.txt"), str(tmp_path / "l.parquet"), "http://example.com/b.webm"])
    assert found == sorted([url, str(videos[0]), str(videos[1]), "rtsp://camera/1", "http://example.com/b.webm"])
    pq.write_table(pa.table({"path": [1, 2]}), tmp_path / "bad.parquet")
    with pytest.raises(ValueError, match="column 'path' must hold strings"):
        expand_inputs([str(tmp_path / "bad.parquet")])


def test_options_are_checked_before_any_video_is_read(folder, tmp_path, capsys):
    out = tmp_path / "captions.jsonl"
    for options, message in ((["--max-frames", "2"], "--max-frames 2 is below 4, the fewest frames a video is "
                                                     "sampled to; use --max-frames 4 or more"),
                             (["--fps", "0"], "--fps must be a positive number, got 0.0"),
                             (["--prompt", " "], "--prompt is empty"),
                             (["--shard", "3/2"], "--shard 3/2: need 0 <= i < n"),
                             (["--device", "gpu"], "--device gpu: not a torch device"),
                             (["--device", f"cuda:{torch.cuda.device_count()}"],
                              f"this machine has {torch.cuda.device_count()} CUDA device(s)")):  # fmt: skip
        with pytest.raises(SystemExit) as exit:
            caption.main([str(folder), "--out", str(out), *options])
        assert exit.value.code == 2
        err = capsys.readouterr().err
        assert message in err and "min_frames" not in err
    with pytest.raises(SystemExit, match="error: --max-new-tokens 40000 leaves no room for a video in the model's "
                                         "context of 32768 tokens"):  # fmt: skip
        caption.main([str(folder), "--out", str(out), "--max-new-tokens", "40000"])
    assert not out.exists()  # refused before the output was opened (issue 43)


def test_a_store_that_wrote_nothing_leaves_no_file(tmp_path):
    made, kept = tmp_path / "new.jsonl", tmp_path / "old.jsonl"
    kept.write_text("")
    for path in (made, kept):
        CaptionStore(path).close()
    assert not made.exists() and kept.exists()
    with CaptionStore(made) as store:
        store.write({"path": "/v.mp4", "error": None})
    assert read_records(made) == [{"path": "/v.mp4", "error": None}]


def retry_inputs(tmp_path: Path) -> tuple[list[Path], Path, Path, Path]:
    """(videos, late, corrupt, listing): a list of 2 videos, late.mp4 (not there yet) and a corrupt one."""
    videos = write_videos(tmp_path / "v", 2)
    late, corrupt = tmp_path / "v" / "late.mp4", tmp_path / "v" / "corrupt.mp4"
    corrupt.write_bytes(b"not a video " * 50)
    listing = tmp_path / "list.txt"
    listing.write_text("".join(f"{p}\n" for p in [*videos, late, corrupt]))
    return videos, late, corrupt, listing


@pytest.mark.slow
def test_retry_errors_redoes_only_failed_videos(tmp_path, capsys):
    videos, late, corrupt, listing = retry_inputs(tmp_path)
    out = tmp_path / "captions.jsonl"
    command = [str(listing), "--out", str(out), *FAST]
    assert caption.main(command) == 0
    first = read_records(out)
    assert sorted(Path(r["path"]).name for r in first if r["error"]) == ["corrupt.mp4", "late.mp4"]

    write_videos(tmp_path / "late", 1)[0].rename(late)  # the missing video arrives
    assert caption.main(command) == 0  # without --retry-errors, errors stay as they are
    assert "2 with error records (skipped; --retry-errors retries them), 0 to caption" in capsys.readouterr().err
    assert read_records(out) == first

    assert caption.main([*command, "--retry-errors"]) == 0
    assert "2 already captioned" in capsys.readouterr().err
    records = read_records(out)
    assert records[: len(first)] == first  # appended, never rewritten
    retried = records[len(first) :]
    assert sorted(Path(r["path"]).name for r in retried) == ["corrupt.mp4", "late.mp4"]
    captions = [r["path"] for r in records if r["error"] is None]
    assert sorted(captions) == sorted(map(str, [*videos, late]))  # each captioned exactly once
    assert [r["error"] is None for r in retried if r["path"] == str(corrupt)] == [False]

    assert caption.main([*command, "--retry-errors"]) == 0  # only the still corrupt one is retried
    assert [r["path"] for r in read_records(out)[len(records) :]] == [str(corrupt)]


@pytest.mark.subprocess
def test_user_errors_are_one_line_without_traceback(folder, tmp_path):
    out = tmp_path / "captions.jsonl"
    with pytest.raises(SystemExit, match=r"^error: input not found: .*nope$"):
        caption.main([str(tmp_path / "nope"), "--out", str(out)])
    llama = tmp_path / "llama"
    llama.mkdir()
    (llama / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(SystemExit, match=r"^error: unsupported model_type 'llama'"):
        caption.main([str(folder), "--out", str(out), "--model", str(llama)])
    with pytest.raises(SystemExit, match=r"^error: .* has no config.json"):
        caption.main([str(folder), "--out", str(out), "--model", str(folder)])
    with CaptionStore(out):  # a captioner holds the output; a second one, in its own process:
        command = [sys.executable, "-m", "app.caption", str(folder), "--out", str(out)]
        result = subprocess.run(command, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True,
                                text=True, timeout=300)  # fmt: skip
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.strip().splitlines()[-1] == (f"error: {out} is being written by another captioner; give each "
                                                      "process (shard) its own --out file")  # fmt: skip
