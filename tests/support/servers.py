"""Servers for the tests: `python -m flipjax.serve` on a free loopback port, healthy before a
test uses it, and always stopped, killed if it will not stop, so no test leaves one behind."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import httpx

from tests.support.http import HTTP
from tests.support.paths import REPO_ROOT

ROOT = str(REPO_ROOT)
STOP_S = 30  # a server stops within this after SIGTERM, or is killed


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Fewer step shapes to compile (decode up to 16 rows, prefill chunks up to 64 tokens).
SMALL = ("--max-running-requests", "16", "--max-prefill-tokens", "64", "--no-warmup")
# For servers whose tests call admin routes without a key (the default refuses them).
INSECURE_ADMIN = "--allow-insecure-admin"


def start_server(log, *flags: str) -> tuple[subprocess.Popen, str]:
    """A server subprocess on a free loopback port, logging to `log` (a file, never a pipe
    nobody reads, which would block the server once full), healthy when this returns."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "flipjax.serve", "--port", str(port), *flags],
        cwd=ROOT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, base, log.name)
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    return proc, base


def wait_healthy(proc: subprocess.Popen, base: str, log_path: str) -> None:
    deadline = time.monotonic() + 180
    while True:
        if proc.poll() is not None:
            with open(log_path) as f:
                raise RuntimeError(f"server exited early:\n{f.read()}")
        try:
            if HTTP.get(f"{base}/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError("server did not become healthy in 180 s")
        time.sleep(0.5)


def stop_server(proc: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL after `STOP_S`; reaped either way."""
    proc.terminate()
    try:
        proc.wait(timeout=STOP_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise


def metric(server: str, name: str) -> float:
    """The value of one sample line in /metrics (0 if absent)."""
    text = HTTP.get(f"{server}/metrics", timeout=30).text
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0
