"""The server's http(s) media fetch, guarded: which hosts and addresses it may reach (checked after DNS
resolution and again on every redirect), one wall-clock deadline for the whole fetch, a size limit.

A refused or failed fetch says "could not fetch URL ..." and our own reason (a limit or a policy),
never the remote's status, reason, size or whether a port is open.
"""

from __future__ import annotations

import http.client
import ipaddress
import socket
import ssl
import threading
import time
import urllib.parse
from dataclasses import dataclass

_CHUNK = 1 << 16
MAX_REDIRECTS = 5
_REDIRECTS = (301, 302, 303, 307, 308)


class FetchError(Exception):
    """A URL that could not be fetched; the message is safe to show the client."""


@dataclass(frozen=True)
class FetchPolicy:
    """Which URLs may be fetched: `allow_remote` any host, or only `allowed_hosts` when given;
    addresses that are not global (private, loopback, link-local, ...) only with `allow_private`."""

    allow_remote: bool = True
    allowed_hosts: frozenset[str] | None = None
    allow_private: bool = False
    timeout: float = 10.0  # seconds for the whole fetch, redirects included


def fetch(url: str, policy: FetchPolicy, max_bytes: int) -> bytes:
    """The body behind an http(s) `url` (at most `max_bytes`), following at most MAX_REDIRECTS
    redirects; FetchError otherwise."""
    deadline = time.monotonic() + policy.timeout
    for _ in range(MAX_REDIRECTS + 1):
        parts = _check_url(url, policy)
        addresses = resolve(parts.hostname, parts.port or _port(parts), policy)
        location = _get(parts, addresses, policy, deadline, max_bytes)
        if isinstance(location, bytes):
            return location
        url = urllib.parse.urljoin(url, location)
    raise FetchError(f"more than {MAX_REDIRECTS} redirects")


def resolve(host: str, port: int, policy: FetchPolicy) -> list[tuple]:
    """The socket addresses of `host`; FetchError if any of them is not global and `allow_private` is off."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        raise FetchError("the host name does not resolve") from None
    if not policy.allow_private:
        for info in infos:
            address = ipaddress.ip_address(info[4][0].split("%")[0])
            if not address.is_global:
                raise FetchError("its address is not public (private, loopback or link-local addresses "
                                 "are fetched only with --allow-private-media)")  # fmt: skip
    return [info for info in infos if info[0] in (socket.AF_INET, socket.AF_INET6)]


def _check_url(url: str, policy: FetchPolicy) -> urllib.parse.SplitResult:
    try:
        parts = urllib.parse.urlsplit(url)
        parts.port  # noqa: B018 - raises ValueError for a malformed port
    except ValueError:
        raise FetchError("the URL is malformed") from None
    if parts.scheme.lower() not in ("http", "https") or not parts.hostname:
        raise FetchError("only http(s) URLs with a host are fetched")
    if policy.allowed_hosts is not None:
        if parts.hostname.lower() not in policy.allowed_hosts:
            raise FetchError("its host is not in the server's --allowed-media-hosts")
    elif not policy.allow_remote:
        raise FetchError("this server does not fetch remote media (start it with --allow-remote-media or "
                         "--allowed-media-hosts), send a data: URI instead")  # fmt: skip
    return parts


def _port(parts: urllib.parse.SplitResult) -> int:
    return 443 if parts.scheme.lower() == "https" else 80


def _get(parts: urllib.parse.SplitResult, addresses: list[tuple], policy: FetchPolicy, deadline: float,
         max_bytes: int) -> bytes | str:  # fmt: skip
    """GET over a connection to one of the checked `addresses`: the body, or a redirect's Location."""
    connection = _Connection(parts, addresses, deadline)
    watchdog = threading.Timer(max(deadline - time.monotonic(), 0), connection.cut)
    watchdog.start()
    try:
        path = urllib.parse.urlunsplit(("", "", parts.path or "/", parts.query, ""))
        connection.request("GET", path, headers={"User-Agent": "qwen35-vl-serve", "Accept-Encoding": "identity"})
        response = connection.getresponse()
        if response.status in _REDIRECTS and response.getheader("Location"):
            return response.getheader("Location")
        if response.status != 200:
            raise FetchError("the server did not return the media")
        return _body(response, policy, deadline, max_bytes)
    except (OSError, http.client.HTTPException, ValueError):
        if time.monotonic() >= deadline:
            raise _too_slow(policy) from None
        raise FetchError("the connection failed") from None
    finally:
        watchdog.cancel()
        connection.close()


def _body(response: http.client.HTTPResponse, policy: FetchPolicy, deadline: float, max_bytes: int) -> bytes:
    size = response.getheader("Content-Length")
    if size is not None and size.isdigit() and int(size) > max_bytes:
        raise _too_big(max_bytes)
    chunks, total = [], 0
    while chunk := response.read1(_CHUNK):  # returns what has arrived: the deadline is checked often
        chunks.append(chunk)
        total += len(chunk)
        if total > max_bytes:
            raise _too_big(max_bytes)
        if time.monotonic() >= deadline:
            raise _too_slow(policy)
    if time.monotonic() >= deadline:  # the watchdog cut the connection: what came is incomplete
        raise _too_slow(policy)
    return b"".join(chunks)


def _too_big(max_bytes: int) -> FetchError:
    return FetchError(f"the media is larger than the limit of {max_bytes} bytes (--max-media-bytes)")


def _too_slow(policy: FetchPolicy) -> FetchError:
    return FetchError(f"the fetch took longer than the {policy.timeout:g} s limit (--media-fetch-timeout)")


class _Connection(http.client.HTTPConnection):
    """An HTTP(S) connection to an already checked address (no second DNS look-up), which the
    watchdog can cut at the deadline however slowly the remote sends."""

    def __init__(self, parts: urllib.parse.SplitResult, addresses: list[tuple], deadline: float):
        super().__init__(parts.hostname, parts.port or _port(parts), timeout=max(deadline - time.monotonic(), 0.01))
        self.tls = parts.scheme.lower() == "https"
        self.addresses = addresses
        self._lock = threading.RLock()
        self._cut = False

    def connect(self) -> None:
        error: OSError = OSError("no address")
        for family, kind, proto, _, address in self.addresses:
            sock = socket.socket(family, kind, proto)
            sock.settimeout(self.timeout)
            try:
                sock.connect(address)
            except OSError as failed:
                sock.close()
                error = failed
                continue
            if self.tls:  # the handshake runs after the watchdog can see the socket
                sock = ssl.create_default_context().wrap_socket(sock, server_hostname=self.host,
                                                                do_handshake_on_connect=False)  # fmt: skip
            with self._lock:
                self.sock = sock
            if self._cut:
                self.cut()
            if self.tls:
                sock.do_handshake()
            return
        raise error

    def cut(self) -> None:
        """Shut the socket down (wakes a blocked read); called by the watchdog at the deadline."""
        with self._lock:
            self._cut = True
            if self.sock is not None:
                try:
                    socket.socket.shutdown(self.sock, socket.SHUT_RDWR)  # the plain socket's, also under TLS
                except OSError:
                    pass
