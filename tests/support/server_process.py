"""A spec_engine.launch_server process for the server tests: started, waited for until /health
answers, and stopped."""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
import time
from collections.abc import Iterator

import httpx

from tests.support import forkserver


def _launch_server(argv: list[str], log: str) -> None:
    """The server process: what `python -m spec_engine.launch_server` runs, its output to `log`."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
        os.dup2(fd, stream.fileno())
    from spec_engine.launch_server import main

    main(argv)


@contextlib.contextmanager
def served(flags: list[str], port: int, timeout: float = 120) -> Iterator[str]:
    """The server's URL once /health answers 200 (its output in the error if it exits first).
    The server runs launch_server's main() in a process forked from tests/support/forkserver.py's
    server (torch and the engine imported) rather than a new interpreter that imports them again;
    it is stopped with SIGTERM, as a terminated `python -m spec_engine.launch_server`."""
    with tempfile.TemporaryDirectory() as tmp:
        log = os.path.join(tmp, "server.log")
        proc = forkserver.context().Process(
            target=_launch_server, args=(["--port", str(port), *flags], log)
        )
        proc.start()
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.time() + timeout
            while True:
                if not proc.is_alive():
                    with open(log) as f:
                        raise RuntimeError(f"server exited early:\n{f.read()}")
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
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
                proc.join()
