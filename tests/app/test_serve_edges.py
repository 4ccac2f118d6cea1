"""The server's edges that need no model: a client gone mid-upload, an out-of-range --port, an
invalid config.json."""

from __future__ import annotations

import asyncio
import logging
import subprocess
import sys

import pytest

from app.serve import ServeConfig, create_app
from tests.app.serve_helpers import REPO


def test_a_client_gone_mid_upload_is_a_499_without_a_traceback(caplog):
    app = create_app(backend=None, config=ServeConfig("default"))  # the body never arrives: no backend use
    messages = iter([{"type": "http.request", "body": b'{"model": "def', "more_body": True},
                     {"type": "http.disconnect"}])  # fmt: skip
    sent = []

    async def receive():
        return next(messages)

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": "/v1/chat/completions", "raw_path": b"/v1/chat/completions", "query_string": b"",
             "root_path": "", "headers": [(b"content-type", b"application/json")], "server": ("127.0.0.1", 8000),
             "client": ("127.0.0.1", 5000)}  # fmt: skip
    with caplog.at_level(logging.INFO, logger="app.serve"):
        asyncio.run(app(scope, receive, send))
    assert sent[0]["status"] == 499
    assert any("status=499" in r.getMessage() and "finish=cancelled" in r.getMessage() for r in caplog.records)
    assert not any(r.exc_info or r.levelno >= logging.ERROR for r in caplog.records)


@pytest.mark.subprocess
def test_a_port_out_of_range_is_one_clear_line():
    done = subprocess.run([sys.executable, "-m", "app.serve", "--port", "99999"], capture_output=True, text=True,
                          cwd=REPO, timeout=120)  # fmt: skip
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines()[-1].endswith("argument --port: '99999' is not a TCP port: give 0-65535")


@pytest.mark.subprocess
def test_an_invalid_config_is_one_clear_line(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "qwen3_5_moe", "text_config": {"num_hidden_layers": "x"}}')
    done = subprocess.run([sys.executable, "-m", "app.serve", "--model", str(tmp_path)], capture_output=True,
                          text=True, cwd=REPO, timeout=120)  # fmt: skip
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert done.stderr.strip() == (f"error: {tmp_path / 'config.json'}: a value of the wrong kind (ValueError: "
                                   "invalid literal for int() with base 10: 'x')")
