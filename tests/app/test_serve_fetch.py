"""The server's media fetch: one wall-clock deadline for the whole fetch (a source trickling a byte
every 2 s is cut), its own bounded pool counted in --max-waiting, and the SSRF guard (checked after
DNS resolution and on every redirect). Traffic goes to 127.0.0.1 only."""

from __future__ import annotations

import asyncio
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
import uvicorn

from app.serve import ServeConfig, create_app, fetch_policy, parse_args
from app.serve_backend import Backend, ServerBusy
from app.serve_chat import Limits
from app.serve_fetch import FetchError, FetchPolicy, fetch, resolve
from app.serve_media import MediaPolicy
from tests.app.serve_helpers import free_port

LOCAL = FetchPolicy(allow_private=True, timeout=3)


class _Handler(BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802
        if self.path == "/ok":
            self._reply(200, b"media bytes")
        elif self.path == "/missing":
            self._reply(404, b"secret internal detail")
        elif self.path == "/hop":
            self.send_response(302)
            self.send_header("Location", f"http://localhost:{self.server.server_port}/ok")
            self.end_headers()
        elif self.path == "/trickle":  # a byte every 2 s of a 1000-byte body
            self.send_response(200)
            self.send_header("Content-Length", "1000")
            self.end_headers()
            self._drip(b"x" * 1000)
        elif self.path == "/slow-headers":  # even the status line comes a byte every 2 s
            self._drip(b"HTTP/1.0 200 OK\r\nContent-Length: 1\r\n\r\nx")

    def _reply(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _drip(self, data: bytes) -> None:
        for byte in data:
            try:
                self.wfile.write(bytes([byte]))
                self.wfile.flush()
            except OSError:
                return
            time.sleep(2)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def origin():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}"
    server.shutdown()


@pytest.mark.subprocess
@pytest.mark.parametrize("path", ["/trickle", "/slow-headers"])
def test_the_deadline_covers_the_whole_fetch(origin, path):
    start = time.monotonic()
    with pytest.raises(FetchError, match="3 s limit .--media-fetch-timeout"):
        fetch(origin + path, LOCAL, 1 << 20)
    assert time.monotonic() - start < 4.5


@pytest.mark.parametrize("host", ["169.254.169.254", "10.0.0.1", "192.168.1.1", "100.64.0.1", "::1", "127.0.0.1",
                                  "::ffff:127.0.0.1", "fe80::1", "0.0.0.0", "localhost"])  # fmt: skip
def test_non_public_addresses_are_refused_after_resolving(host):
    with pytest.raises(FetchError, match="not public.*--allow-private-media"):
        resolve(host, 80, FetchPolicy())  # resolving only: no connection is attempted
    url = f"http://[{host}]/latest" if ":" in host else f"http://{host}/latest"
    start = time.monotonic()
    with pytest.raises(FetchError, match="not public"):
        fetch(url, FetchPolicy(), 1 << 20)
    assert time.monotonic() - start < 2


@pytest.mark.subprocess
def test_loopback_only_with_allow_private(origin):
    with pytest.raises(FetchError, match="not public"):
        fetch(origin + "/ok", FetchPolicy(), 1 << 20)
    assert fetch(origin + "/ok", LOCAL, 1 << 20) == b"media bytes"
    assert fetch(origin + "/hop", LOCAL, 1 << 20) == b"media bytes"  # redirect to localhost, checked again


@pytest.mark.subprocess
def test_redirects_and_hosts_are_checked_on_every_hop(origin):
    only_ip = FetchPolicy(allowed_hosts=frozenset({"127.0.0.1"}), allow_private=True, timeout=3)
    assert fetch(origin + "/ok", only_ip, 1 << 20) == b"media bytes"
    with pytest.raises(FetchError, match="--allowed-media-hosts"):  # the redirect goes to localhost
        fetch(origin + "/hop", only_ip, 1 << 20)
    with pytest.raises(FetchError, match="--allow-remote-media"):
        fetch(origin + "/ok", FetchPolicy(allow_remote=False, allow_private=True), 1 << 20)


@pytest.mark.subprocess
def test_errors_do_not_tell_the_remote_details(origin):
    with pytest.raises(FetchError) as caught:
        fetch(origin + "/missing", LOCAL, 1 << 20)
    assert "404" not in str(caught.value) and "secret" not in str(caught.value)
    with pytest.raises(FetchError) as caught:  # nothing listens there
        fetch(f"http://127.0.0.1:{free_port()}/x", LOCAL, 1 << 20)
    assert str(caught.value) == "the connection failed"
    with pytest.raises(FetchError, match="--max-media-bytes"):
        fetch(origin + "/ok", LOCAL, 4)


def test_remote_media_off_by_default_on_a_public_bind():
    assert fetch_policy(parse_args(["--host", "0.0.0.0"])).allow_remote is False
    assert fetch_policy(parse_args(["--host", "127.0.0.1"])).allow_remote is True
    assert fetch_policy(parse_args(["--host", "0.0.0.0", "--allow-remote-media"])).allow_remote is True
    assert fetch_policy(parse_args(["--no-allow-remote-media"])).allow_remote is False
    listed = fetch_policy(parse_args(["--host", "::", "--allowed-media-hosts", "Img.example.com, cdn.example.com"]))
    assert listed.allowed_hosts == {"img.example.com", "cdn.example.com"} and not listed.allow_private
    assert fetch_policy(parse_args(["--allow-private-media", "--media-fetch-timeout", "2"])) == FetchPolicy(
        allow_private=True, timeout=2)


def test_waiting_turn_counts_against_max_waiting(pipeline):
    backend = Backend(pipeline, max_waiting=1)
    with backend.waiting_turn():
        assert backend.waiting == 1
        with pytest.raises(ServerBusy, match="--max-waiting"):
            backend.waiting_turn().__enter__()
    assert backend.waiting == 0


@pytest.fixture()
def fetching_server(pipeline):
    """The app in this process, fetching from loopback, 2 fetch workers, at most 3 requests waiting."""
    media = MediaPolicy(remote=LOCAL, fetch_workers=2)
    backend = Backend(pipeline, max_waiting=3)
    port = free_port()
    app = create_app(backend, ServeConfig("default", limits=Limits(media=media)))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}", backend
    server.should_exit = True
    thread.join(timeout=30)


@pytest.mark.subprocess
def test_slow_fetches_hold_neither_chat_requests_nor_the_queue(fetching_server, origin):
    url, backend = fetching_server
    picture = {"type": "image_url", "image_url": {"url": origin + "/trickle"}}
    slow = {"model": "default", "max_tokens": 2, "messages": [{"role": "user", "content": [picture]}]}
    hi = {"model": "default", "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]}

    async def scenario():
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            start = time.monotonic()
            slow_ones = [asyncio.create_task(client.post("/v1/chat/completions", json=slow)) for _ in range(3)]
            while backend.waiting < 3:  # 3 fetching (2 in the pool, 1 queued for it), each counted as waiting
                await asyncio.sleep(0.05)
            busy = await client.post("/v1/chat/completions", json=hi)
            assert busy.status_code == 503 and "--max-waiting" in busy.json()["error"]["message"]
            replies = await asyncio.gather(*slow_ones)
            for reply in replies:
                message = reply.json()["error"]["message"]
                assert reply.status_code == 400 and "could not fetch URL" in message and "--media-fetch-timeout" in message
            assert time.monotonic() - start < 9  # two rounds of the 3 s deadline in a pool of 2
            assert (await client.post("/v1/chat/completions", json=hi)).status_code == 200

    asyncio.run(scenario())


@pytest.mark.subprocess
@pytest.mark.slow
def test_fetching_leaves_requests_that_need_no_fetch_alone(pipeline, origin):
    media = MediaPolicy(remote=FetchPolicy(allow_private=True, timeout=6), fetch_workers=2)
    app = create_app(Backend(pipeline), ServeConfig("default", limits=Limits(media=media)))
    picture = {"type": "image_url", "image_url": {"url": origin + "/trickle"}}
    slow = {"model": "default", "max_tokens": 2, "messages": [{"role": "user", "content": [picture]}]}
    hi = {"model": "default", "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]}

    async def scenario():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=30) as client:
            slow_ones = [asyncio.create_task(client.post("/v1/chat/completions", json=slow)) for _ in range(8)]
            await asyncio.sleep(0.5)
            start = time.monotonic()
            assert (await client.post("/v1/chat/completions", json=hi)).status_code == 200
            assert time.monotonic() - start < 5  # not behind the fetches (the 6 s deadline)
            await asyncio.gather(*slow_ones)

    asyncio.run(scenario())
