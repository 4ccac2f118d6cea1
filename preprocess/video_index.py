"""Open a video with PyAV and index its frames from the packets (no decoding).

The index holds every frame's presentation timestamp and every keyframe's, so frames can be
chosen by time (variable frame rate included) and reached by seeking to the right keyframe.
"""

from __future__ import annotations

import io
import os
import re
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Union

import av
import numpy as np

from .errors import VideoError

VideoPath = Union[str, os.PathLike, bytes]

_IMAGE_FORMATS = ("image2", "image2pipe")  # plus every "*_pipe" demuxer (png_pipe, jpeg_pipe, ...)
_NETWORK_SCHEMES = ("http://", "https://", "rtsp://")  # opened by FFmpeg's own protocols
URL_TIMEOUT_S = 30.0  # seconds to wait for a video URL to answer
_TRUNCATION_SLACK_S = 1.0  # declared duration may exceed the packets' by this much (or 5%)


@dataclass(frozen=True)
class StreamIndex:
    """Frame timing of one video stream; pts values are integers in units of `time_base`."""

    pts: np.ndarray  # int64 [N], sorted presentation timestamps of all frames
    keyframe_pts: np.ndarray  # int64 [K], sorted, pts of frames that decoding can start from
    time_base: Fraction
    end_pts: int  # where the last frame ends (its pts + its duration)
    average_rate: float  # the stream's average frame rate (frames / second)

    @property
    def duration(self) -> float:
        """Seconds from the first frame's start to the last frame's end."""
        return float((self.end_pts - int(self.pts[0])) * self.time_base)


def open_video(source: VideoPath, name: str) -> av.container.InputContainer:
    """Open `source` (path, URL or encoded bytes) with FFmpeg; VideoError on failure.

    Header text (titles, handler names) that is not UTF-8 means random bytes where the header
    was: the file is refused as corrupt. A URL that FFmpeg cannot open is fetched once more with
    urllib to tell a failed download (no network, HTTP error) from a file that is not a video.
    """
    if isinstance(source, (bytes, bytearray)):
        if not source:
            raise VideoError(f"{name}: video data is empty")
        target: object = io.BytesIO(bytes(source))
    else:
        target = _local_path(source, name)
    url = isinstance(target, str) and target.startswith(_NETWORK_SCHEMES)
    options = {"timeout": URL_TIMEOUT_S} if url else {}
    try:
        container = av.open(target, mode="r", **options)
    except av.error.FFmpegError as e:
        if url:
            _raise_download_failure(target)
        raise VideoError(f"{name}: not a readable video file ({_ffmpeg_reason(e)})") from e
    except UnicodeDecodeError as e:  # PyAV decodes the header's text as strict UTF-8
        raise VideoError(f"{name}: unreadable video, the file is corrupt: its header holds text that is not "
                         f"UTF-8 ({e})") from e
    if container.format.name.endswith("_pipe") or container.format.name in _IMAGE_FORMATS:
        container.close()
        raise VideoError(f"{name}: is a still image ({container.format.name}), not a video")
    return container


def _raise_download_failure(url: str) -> None:
    """VideoError saying why `url` cannot be downloaded; returns when it can (the data is then not a video)."""
    if not url.startswith(("http://", "https://")):
        return
    request = urllib.request.Request(url, headers={"User-Agent": "qwen35-vl-preprocess", "Range": "bytes=0-0"})
    try:
        with urllib.request.urlopen(request, timeout=URL_TIMEOUT_S):
            return
    except urllib.error.HTTPError as e:
        raise VideoError(f"could not download video {url}: HTTP {e.code} {e.reason}") from e
    except (urllib.error.URLError, TimeoutError, OSError) as e:
        raise VideoError(f"could not download video {url}: {getattr(e, 'reason', e)}") from e


def _local_path(source: str | os.PathLike, name: str) -> str:
    text = os.fspath(source)
    if text.startswith(_NETWORK_SCHEMES):
        return text  # FFmpeg's own network protocols
    if text.startswith("file://"):
        text = urllib.request.url2pathname(urllib.parse.urlparse(text).path)
    path = Path(text)
    try:
        if not path.exists():
            raise VideoError(f"video file not found: {name}")
        if not path.is_file():
            raise VideoError(f"{name}: is not a file")
        if path.stat().st_size == 0:
            raise VideoError(f"{name}: file is empty")
    except OSError as e:  # e.g. a name too long for the file system
        raise VideoError(f"cannot read video file {name}: {e.strerror or e}") from e
    return str(path)


def video_stream(container: av.container.InputContainer, name: str) -> av.video.stream.VideoStream:
    """The first video stream (not an embedded cover picture); other streams are not demuxed."""
    streams = [s for s in container.streams.video if not s.disposition & av.stream.Disposition.attached_pic]
    if not streams:
        kinds = ", ".join(s.type for s in container.streams) or "none"
        raise VideoError(f"{name}: has no video stream (streams: {kinds})")
    for other in container.streams:
        if other is not streams[0]:
            other.discard = av.stream.Discard.all  # skip other streams' packets while demuxing
    return streams[0]


def index_stream(container: av.container.InputContainer, stream: av.video.stream.VideoStream,
                 name: str) -> StreamIndex:
    """Demux every packet of `stream` (reading, not decoding) and collect frame timestamps."""
    pts, keys, ends = [], [], []
    try:
        for packet in container.demux(stream):
            if packet.size == 0:
                continue  # end-of-stream marker
            if packet.pts is None:
                raise VideoError(f"{name}: video packets carry no timestamps (raw elementary stream?); "
                                 "remux it into a container such as MP4 or MKV")
            pts.append(packet.pts)
            ends.append(packet.pts + (packet.duration or 0))
            if packet.is_keyframe:
                keys.append(packet.pts)
    except av.error.FFmpegError as e:
        raise VideoError(f"{name}: corrupt or truncated video ({_ffmpeg_reason(e)})") from e
    if not pts:
        raise VideoError(f"{name}: video stream has no frames")
    if not keys:
        raise VideoError(f"{name}: video stream has no keyframe to start decoding from")
    index = _build_index(pts, keys, ends, stream)
    _check_complete(index, len(pts), stream, container, name)
    return index


def _build_index(pts: list[int], keys: list[int], ends: list[int], stream) -> StreamIndex:
    all_pts = np.unique(np.asarray(pts, dtype=np.int64))
    rate = stream.average_rate or stream.guessed_rate
    time_base = stream.time_base
    end_pts = max(ends)
    if end_pts <= all_pts[-1]:  # packets without durations: assume one frame interval
        step = (1 / (rate * time_base)) if rate else 1
        end_pts = int(all_pts[-1] + max(1, round(step)))
    average = float(rate) if rate else float(len(all_pts) / ((end_pts - all_pts[0]) * time_base))
    return StreamIndex(all_pts, np.unique(np.asarray(keys, dtype=np.int64)), time_base, int(end_pts), average)


def _check_complete(index: StreamIndex, packets: int, stream, container, name: str) -> None:
    """VideoError when the header promises more video than the file holds (a truncated file)."""
    if stream.frames and packets < stream.frames:
        raise VideoError(f"{name}: truncated video: the header declares {stream.frames} frames "
                         f"but only {packets} are in the file")
    declared = _declared_seconds(stream, container)
    found = float((index.end_pts - (stream.start_time or 0)) * index.time_base)
    if declared is not None and declared - found > max(_TRUNCATION_SLACK_S, 0.05 * declared):
        raise VideoError(f"{name}: truncated video: the header declares {declared:.2f} s "
                         f"but the file holds only {found:.2f} s of video")


def _declared_seconds(stream, container) -> float | None:
    if stream.duration:
        return float(stream.duration * stream.time_base)
    tag = stream.metadata.get("DURATION") or stream.metadata.get("duration")
    match = re.fullmatch(r"(\d+):(\d+):(\d+(?:\.\d+)?)", tag or "")
    if match:
        hours, minutes, seconds = match.groups()
        return int(hours) * 3600 + int(minutes) * 60 + float(seconds)
    if container.duration and len(container.streams) == 1:
        return container.duration / av.time_base
    return None


def _ffmpeg_reason(error: av.error.FFmpegError) -> str:
    return getattr(error, "strerror", None) or str(error)
