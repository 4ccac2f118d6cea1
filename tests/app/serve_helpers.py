"""`python -m app.serve` as the tests run it: a real server process on a free loopback port."""

from __future__ import annotations

import base64
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

API_KEY = "test-key"
REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class Server:
    """A running server: its base URL, process and log file (stderr)."""

    url: str
    process: subprocess.Popen
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_idle(self, seconds: float) -> dict:
        """/health once nothing runs or waits (or when `seconds` ran out)."""
        deadline = time.monotonic() + seconds
        while True:
            health = httpx.get(f"{self.url}/health", timeout=5).json()
            if (health["running"] == 0 and health["waiting"] == 0) or time.monotonic() > deadline:
                return health
            time.sleep(0.1)


def start_server(args: list[str], log_path: Path, *, timeout: float = 600.0) -> Server:
    """Start `python -m app.serve ARGS` on a free port; returns once /health answers."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    env.pop("QWEN35_API_KEY", None)
    log = log_path.open("w")
    process = subprocess.Popen([sys.executable, "-m", "app.serve", "--port", str(port), *args], cwd=REPO, env=env,
                               stdout=log, stderr=subprocess.STDOUT)  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout  # the first run may build the C++ kernels
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with {process.returncode}:\n{log_path.read_text()}")
        try:
            httpx.get(f"{url}/health", timeout=2)
            return Server(url, process, log_path)
        except httpx.TransportError:
            if time.monotonic() > deadline:
                process.kill()
                raise RuntimeError(f"the server did not answer within {timeout:g} s:\n{log_path.read_text()}")
            time.sleep(0.5)


def stop_server(server: Server) -> None:
    server.process.terminate()
    try:
        server.process.wait(timeout=20)
    except subprocess.TimeoutExpired:
        server.process.kill()
        server.process.wait(timeout=20)


def data_uri(path: Path, mime: str) -> str:
    return f"data:{mime};base64,{base64.b64encode(path.read_bytes()).decode()}"
