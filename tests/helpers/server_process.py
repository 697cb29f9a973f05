"""Servers started as subprocesses by the tests: a free port and waiting for /health."""

from __future__ import annotations

import signal
import socket
import subprocess
import time

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(proc: subprocess.Popen[str], url: str, timeout: float = 90) -> None:
    """Returns once ``url``/health answers 200; fails with the server's output if it exits,
    or when ``timeout`` seconds pass."""
    deadline = time.monotonic() + timeout
    while True:
        assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "server did not come up"
        time.sleep(0.2)


def stop(proc: subprocess.Popen[str], sig: int = signal.SIGINT, timeout: float = 60) -> int:
    """Sends ``sig`` and waits for the exit (killing the process after ``timeout`` seconds);
    returns its exit status."""
    proc.send_signal(sig)
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()
