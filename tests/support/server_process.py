"""A `python -m spec_engine.launch_server` process for the server tests: started, waited for
until /health answers, and stopped."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx


@contextlib.contextmanager
def served(flags: list[str], port: int, timeout: float = 120) -> Iterator[str]:
    """The server's URL once /health answers 200 (its output in the error if it exits first)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "spec_engine.launch_server", "--port", str(port), *flags],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited early:\n{proc.stdout.read().decode()}")
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.time() > deadline:
                raise RuntimeError("server did not start")
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
