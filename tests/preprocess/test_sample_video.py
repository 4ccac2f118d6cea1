"""sample_video on small videos encoded by the tests, each frame's index painted into its pixels."""

import functools
import http.server
import threading
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from preprocess import VideoError, sample_video
from preprocess import video_decode
from preprocess.video_index import index_stream, open_video, video_stream
from tests.preprocess import video_files
from tests.preprocess.video_files import read_index


@pytest.fixture(scope="module")
def videos(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("videos")
    video_files.encode(folder / "cfr.mp4", 100, fps=10)  # 10 s, keyframe every second
    video_files.encode(folder / "long.mp4", 240, fps=10, gop=5)  # 24 s, keyframe every 0.5 s
    video_files.encode(folder / "cfr.mkv", 100, fps=10, container_format="matroska")
    return folder


def _painted(clip) -> list[int]:
    return [read_index(frame) for frame in clip.frames]


def test_fps_sampling(videos):
    clip = sample_video(videos / "cfr.mp4")  # 10 s at 2 fps -> 20 frames
    expected = np.linspace(0, 99, 20).round().astype(int).tolist()
    assert clip.frame_indices == expected and _painted(clip) == expected
    assert clip.timestamps == [i / 10 for i in expected]
    assert clip.frames.shape == (20, 48, 64, 3) and clip.frames.dtype == np.uint8
    assert (clip.source_fps, clip.duration, clip.total_frames) == (10.0, 10.0, 100)
    assert _painted(sample_video(videos / "cfr.mp4", fps=0.5)) == [0, 33, 66, 99]  # 5 -> 4 frames
    assert _painted(sample_video(videos / "cfr.mkv", fps=1.0)) == np.linspace(0, 99, 10).round().astype(int).tolist()


def test_num_frames_and_window(videos):
    assert _painted(sample_video(videos / "cfr.mp4", num_frames=8)) == [0, 14, 28, 42, 57, 71, 85, 99]
    clip = sample_video(videos / "cfr.mp4", start=2.0, end=5.0)
    assert _painted(clip) == [20, 26, 32, 38, 44, 50] and clip.timestamps == [2.0, 2.6, 3.2, 3.8, 4.4, 5.0]
    clip = sample_video(videos / "cfr.mp4", num_frames=4, start=7.05)
    assert _painted(clip) == [71, 80, 90, 99]
    with pytest.raises(ValueError, match="no frame between"):
        sample_video(videos / "cfr.mp4", start=11.0)


def test_variable_frame_rate_samples_by_time(tmp_path):
    times_ms = [0, 100, 150, 400, 410, 420, 1000, 1010, 1500, 2000]
    path = video_files.encode(tmp_path / "vfr.mp4", len(times_ms), pts_ms=times_ms)
    clip = sample_video(path, num_frames=6)  # targets 0, .4, .8, 1.2, 1.6, 2.0 s
    assert _painted(clip) == [0, 3, 6, 7, 8, 9] and clip.frame_indices == [0, 3, 6, 7, 8, 9]
    assert clip.timestamps == [0.0, 0.4, 1.0, 1.01, 1.5, 2.0]


@pytest.mark.parametrize("degrees", [90, 180, 270])
def test_rotation_is_applied(tmp_path, degrees):
    path = video_files.encode(tmp_path / "rotated.mp4", 20, rotation=degrees)
    clip = sample_video(path, num_frames=4)
    turns = degrees // 90  # counter-clockwise quarter turns in the display matrix
    assert clip.frames.shape == ((4, 64, 48, 3) if turns % 2 else (4, 48, 64, 3))
    assert [read_index(np.rot90(f, -turns)) for f in clip.frames] == [0, 6, 13, 19]
    upright_top_half = np.rot90(clip.frames[1], -turns)[:24]
    assert upright_top_half.std() > 50  # the painted bits are back on top


def test_old_style_rotate_tag_is_applied(tmp_path):
    path = video_files.encode(tmp_path / "tagged.mkv", 20, rotate_tag="90", container_format="matroska")
    clip = sample_video(path, num_frames=4)  # "rotate"=90 means turn 90 degrees clockwise
    assert clip.frames.shape == (4, 64, 48, 3)
    assert [read_index(np.rot90(f, 1)) for f in clip.frames] == [0, 6, 13, 19]


def test_too_short_video_is_padded(tmp_path):
    clip = sample_video(video_files.encode(tmp_path / "short.mp4", 3), fps=2.0)
    assert _painted(clip) == [0, 1, 2, 2] and clip.timestamps == [0.0, 0.1, 0.2, 0.2]
    single = sample_video(video_files.encode(tmp_path / "one.mp4", 1))
    assert single.frames.shape[0] == 2 and single.frame_indices == [0, 0]


def test_sparse_and_dense_decoding_give_identical_frames(videos, monkeypatch):
    path = videos / "long.mp4"
    with open_video(path, "long") as container:
        index = index_stream(container, video_stream(container, "long"), "long")
    wanted = [int(index.pts[i]) for i in (3, 60, 61, 150, 239)]
    assert len(video_decode.plan_runs(wanted, index)) == 4  # seeks: 3 | 60, 61 | 150 | 239
    sparse = sample_video(path, num_frames=8)
    full = sample_video(path, num_frames=240)
    assert len(video_decode.plan_runs([int(p) for p in index.pts], index)) == 1  # dense: one pass
    monkeypatch.setattr(video_decode, "SEEK_MIN_SKIP", 10**9)  # force one sequential pass
    sequential = sample_video(path, num_frames=8)
    assert np.array_equal(sparse.frames, sequential.frames)
    assert np.array_equal(sparse.frames, full.frames[sparse.frame_indices])
    assert _painted(sparse) == [0, 34, 68, 102, 137, 171, 205, 239]


def test_bytes_and_url_sources(videos):
    assert _painted(sample_video((videos / "cfr.mp4").read_bytes(), num_frames=4)) == [0, 33, 66, 99]
    assert _painted(sample_video((videos / "cfr.mp4").as_uri(), num_frames=4)) == [0, 33, 66, 99]


def test_errors_name_the_file(tmp_path):
    (tmp_path / "notes.mp4").write_text("hello, not a video\n" * 20)
    (tmp_path / "empty.mp4").write_bytes(b"")
    Image.new("RGB", (16, 16)).save(tmp_path / "picture.png")
    (tmp_path / "picture.png").rename(tmp_path / "picture.mp4")
    with pytest.raises(VideoError, match="notes.mp4.*not a readable video"):
        sample_video(tmp_path / "notes.mp4")
    with pytest.raises(VideoError, match="empty.mp4.*empty"):
        sample_video(str(tmp_path / "empty.mp4"))
    with pytest.raises(VideoError, match="video data is empty"):
        sample_video(b"")
    with pytest.raises(VideoError, match="not found.*missing.mp4"):
        sample_video(tmp_path / "missing.mp4")
    with pytest.raises(VideoError, match="audio.m4a.*no video stream.*audio"):
        sample_video(video_files.encode_audio_only(tmp_path / "audio.m4a"))
    with pytest.raises(VideoError, match="picture.mp4.*still image"):
        sample_video(tmp_path / "picture.mp4")
    with pytest.raises(VideoError, match="nothing.avi: video stream has no frames"):
        sample_video(video_files.encode_no_frames(tmp_path / "nothing.avi"))


def test_garbled_mp4_is_called_unreadable(tmp_path):
    data = bytearray(video_files.encode(tmp_path / "clip.mp4", 200, movflags="faststart").read_bytes())
    start, middle = data.find(b"Lavf"), len(data) // 2  # random bytes from the header's encoder tag to the middle
    data[start:middle] = b"\xbc" + np.random.default_rng(0).integers(0, 256, middle - start - 1, np.uint8).tobytes()
    (tmp_path / "garbled.mp4").write_bytes(bytes(data))
    with pytest.raises(VideoError, match=r"garbled.mp4: unreadable video, the file is corrupt: its header holds text "
                                         r"that is not UTF-8 \('utf-8' codec can't decode byte 0xbc"):  # fmt: skip
        sample_video(tmp_path / "garbled.mp4")


@pytest.fixture
def http_folder(tmp_path):
    """A local HTTP server over tmp_path: its URL."""
    handler = functools.partial(_QuietHandler, directory=str(tmp_path))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass


@pytest.mark.subprocess
def test_video_urls_that_fail_say_the_download_failed(tmp_path, videos, http_folder):
    (tmp_path / "cfr.mp4").write_bytes((videos / "cfr.mp4").read_bytes())
    (tmp_path / "notes.mp4").write_text("hello, not a video\n" * 20)
    assert _painted(sample_video(f"{http_folder}/cfr.mp4", num_frames=4)) == [0, 33, 66, 99]
    with pytest.raises(VideoError, match=f"could not download video {http_folder}/missing.mp4: HTTP 404"):
        sample_video(f"{http_folder}/missing.mp4")
    with pytest.raises(VideoError, match=r"could not download video http://127.0.0.1:9/x.mp4: .*refused"):
        sample_video("http://127.0.0.1:9/x.mp4")  # nothing listens on port 9
    with pytest.raises(VideoError, match="could not download video http://host.invalid/x.mp4: "):
        sample_video("http://host.invalid/x.mp4")  # a name that never resolves, as without network
    with pytest.raises(VideoError, match=f"{http_folder}/notes.mp4: not a readable video file"):
        sample_video(f"{http_folder}/notes.mp4")  # downloads, but is no video


@pytest.mark.parametrize("name, message", [
    ("cfr.mp4", "not a readable video"),  # MP4 with its index at the end: the index is lost
    ("cfr.mkv", "truncated video: the header declares 10.00 s"),  # MKV: no frame count, only a duration
    ("faststart.mp4", "truncated video: the header declares 100 frames"),  # index first, data missing
])
def test_truncated_files(tmp_path, videos, name, message):
    if name == "faststart.mp4":
        source = video_files.encode(tmp_path / name, 100, movflags="faststart")
    else:
        source = videos / name
    data = source.read_bytes()
    cut = tmp_path / f"cut-{name}"
    cut.write_bytes(data[: len(data) // 2])
    with pytest.raises(VideoError, match=f"cut-{name}: {message}"):
        sample_video(cut)
