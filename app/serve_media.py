"""The bytes behind a request's `image_url` / `video_url`: data URIs, http(s) URLs (fetched under a
`FetchPolicy`: app/serve_fetch.py) and, only under `--allowed-local-media-path`, `file://` URLs and local paths.

Everything becomes bytes here, so the processor never reads a path or a URL a client chose.
"""

from __future__ import annotations

import base64
import binascii
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from preprocess.budget import DEFAULT_MAX_PIXELS

from .openai_protocol import APIError, bad_request
from .serve_fetch import FetchError, FetchPolicy, fetch


@dataclass(frozen=True)
class MediaPolicy:
    """Where media may come from and how much: `max_bytes` per item, `remote` which http(s) URLs may
    be fetched and how long one fetch may take, `allowed_local` the only folder whose files may be
    read (None: no local files), `max_pixels` the pixel budget of one image or one video's frames
    (preprocess.budget), `fetch_workers` the fetches running at once (their own thread pool)."""

    max_bytes: int = 64 << 20
    remote: FetchPolicy = field(default_factory=FetchPolicy)
    allowed_local: Path | None = None
    max_pixels: int = DEFAULT_MAX_PIXELS
    fetch_workers: int = 8


def media_bytes(url: str, policy: MediaPolicy, where: str) -> bytes:
    """The encoded image or video at `url`; `APIError` 400 naming `where` and the problem otherwise."""
    scheme = urllib.parse.urlsplit(url).scheme.lower() if "://" in url or url.startswith("data:") else ""
    if scheme == "data":
        data = _data_uri(url, where)
    elif scheme in ("http", "https"):
        data = _download(url, policy, where)
    elif scheme == "file" or not scheme:
        data = _local_file(url, policy, where)
    else:
        raise bad_request(f"{where}: unsupported URL scheme {scheme!r}; use a data: URI, http(s):// or, "
                          "with --allowed-local-media-path, file://", "messages")  # fmt: skip
    if len(data) > policy.max_bytes:
        raise _too_big(where, policy)
    if not data:
        raise bad_request(f"{where}: the media is empty", "messages")
    return data


def _data_uri(url: str, where: str) -> bytes:
    header, comma, payload = url.partition(",")
    if not comma:
        raise bad_request(f"{where}: malformed data URI (no ',' before the data)", "messages")
    if header.endswith(";base64"):
        try:
            return base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError) as error:
            raise bad_request(f"{where}: the data URI's base64 is invalid ({error})", "messages") from None
    return urllib.parse.unquote_to_bytes(payload)


def _download(url: str, policy: MediaPolicy, where: str) -> bytes:
    try:
        return fetch(url, policy.remote, policy.max_bytes)
    except FetchError as error:
        raise bad_request(f"{where}: could not fetch URL {_short(url)}: {error}", "messages") from None


def _local_file(url: str, policy: MediaPolicy, where: str) -> bytes:
    if policy.allowed_local is None:
        raise bad_request(f"{where}: local files (file:// or paths) are not served; the server must be started "
                          "with --allowed-local-media-path DIR, or send a data: URI", "messages")  # fmt: skip
    text = url
    if url.lower().startswith("file://"):
        text = urllib.request.url2pathname(urllib.parse.urlsplit(url).path)
    root = policy.allowed_local.resolve()
    path = Path(text).expanduser().resolve()
    if not path.is_relative_to(root):
        raise bad_request(f"{where}: {text} is outside the allowed local media folder {root}", "messages")
    if not path.is_file():
        raise bad_request(f"{where}: no such file: {text}", "messages")
    if path.stat().st_size > policy.max_bytes:
        raise _too_big(where, policy)
    return path.read_bytes()


def _too_big(where: str, policy: MediaPolicy) -> APIError:
    return bad_request(f"{where}: the media is larger than the limit of {policy.max_bytes} bytes "
                       "(--max-media-bytes)", "messages", "media_too_large")  # fmt: skip


def _short(url: str) -> str:
    return url if len(url) <= 120 else url[:120] + "..."
