"""A benchmark engine in a process of its own, started afresh each round (bench_rollout --isolate).

Why: on CPU an engine's speed depends on where its memory landed, and that stays with the
engine. Two identical plain Llama engines alternating in one process (batch 32, 128 tokens, 8
rounds, turns alternating) ran the one created second at a median 0.91x of the first one
session and 1.06x the next; in two processes 1.04x: an offset per engine instance, up to ~10%,
that no number of rounds of the same engines averages away, and larger than the differences an
adaptive mode's 0.95x target is about. An engine in a fresh process each round draws a new
layout each round, so the median of per-round ratios tends to the configurations' own
difference.
"""

from __future__ import annotations

import argparse
import multiprocessing
import traceback
from multiprocessing.connection import Connection
from typing import Any

from scripts.bench_measure import measure, open_engine, warm_up

# What the parent may ask of the engine, each called as fn(engine, batch, args, *call_args).
CALLS = {"warm_up": warm_up, "measure": measure}


def _serve(conn: Connection, path: str, kwargs: dict, batch: int, args: argparse.Namespace) -> None:
    """The child: open the engine, report its weight bytes, then answer calls until told to stop
    (None); an exception goes back to the parent as its traceback."""
    try:
        with open_engine(path, kwargs, batch, args) as engine:
            conn.send(("ok", engine.runner.weight_bytes()))
            while (request := conn.recv()) is not None:
                name, call_args = request
                try:
                    conn.send(("ok", CALLS[name](engine, batch, args, *call_args)))
                except Exception:
                    conn.send(("error", traceback.format_exc()))
    except Exception:
        conn.send(("error", traceback.format_exc()))


class EngineProcess:
    """open_engine(path, kwargs, batch, args) in a spawned process; `call` runs one of CALLS
    there and returns its result."""

    def __init__(self, path: str, kwargs: dict, batch: int, args: argparse.Namespace) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(
            target=_serve, args=(child, path, kwargs, batch, args), daemon=True
        )
        self._proc.start()
        self.pid = self._proc.pid
        child.close()
        try:
            self.weight_bytes: int = self._answer()
        except RuntimeError:
            self.close()
            raise

    def call(self, name: str, *call_args: Any) -> Any:
        if name not in CALLS:
            raise ValueError(f"no benchmark call {name!r}; one of {sorted(CALLS)}")
        self._conn.send((name, call_args))
        return self._answer()

    def _answer(self) -> Any:
        try:
            status, value = self._conn.recv()
        except EOFError:
            self._proc.join(timeout=10)
            raise RuntimeError(
                f"the benchmark engine process died (exit code {self._proc.exitcode}); "
                "its stderr above says why"
            ) from None
        if status == "error":
            raise RuntimeError(f"in the benchmark engine process:\n{value}")
        return value

    def close(self) -> None:
        if self._proc.is_alive():
            self._conn.send(None)
            self._proc.join(timeout=60)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join()
        self._conn.close()

    def __enter__(self) -> EngineProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
