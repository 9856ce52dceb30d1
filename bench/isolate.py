"""A benchmark engine in a process of its own, started afresh each round (bench_rollout --isolate).

Why: on CPU an engine's speed depends on where its memory landed, and that stays with the
engine. Two identical plain Llama engines alternating in one process (batch 32, 128 tokens, 8
rounds, turns alternating) ran the one created second at a median 0.91x of the first one
session and 1.06x the next; in two processes 1.04x: an offset per engine instance, up to ~10%,
that no number of rounds of the same engines averages away, and larger than the differences an
adaptive mode's 0.95x target is about. An engine in a fresh process each round draws a new
layout each round, so the median of per-round ratios tends to the configurations' own
difference.

Lockstep (bench_rollout --lockstep): a shared VM's speed also drifts within a round. The same
matrix multiplications, timed in blocks of 1.2 s one after another, took 1.03 s to 1.52 s, rising
and falling over seconds, so two engines timed a generation apart (7 s each at batch 32) differ
by ~10% round by round. Run with a StepGate, every engine of a round waits for its turn before
each scheduler step and times only its steps (`StepGate.clock`), and `drive` gives the engines
one step each in turn: a slow spell falls on all of them within one turn of the engines (seven:
0.1 s at batch 1, about a second at batch 64), not on whichever ran then.
"""

from __future__ import annotations

import argparse
import functools
import multiprocessing
import os
import threading
import time
import traceback
from collections.abc import Callable, Mapping
from multiprocessing.connection import Connection, wait
from typing import TYPE_CHECKING, Any, Optional

from bench.measure import measure, open_engine, warm_up

if TYPE_CHECKING:
    from spec_engine import Engine


class StepGate:
    """The child's side of lockstep: installed on an engine's scheduler, each step (while `on`)
    first asks the parent for its turn over `conn` and reports when done; `busy` counts the
    seconds of those steps alone."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.on = False
        self.busy = 0.0
        # The same steps by the scheduler thread's CPU clock: on a machine shared with other
        # processes, what a step cost without the time it waited for a core (with one torch
        # thread, all of a CPU step's work runs on that thread).
        self.busy_cpu = 0.0
        self.readings: list[tuple[float, float]] = []  # (busy, busy_cpu) at each clock()

    def install(self, engine: Engine) -> None:
        step = engine.scheduler.step

        def gated() -> None:
            if not self.on:
                return step()
            self.conn.send("ready")
            self.conn.recv()
            start, start_cpu = time.perf_counter(), time.thread_time()
            try:
                step()
            finally:
                self.busy += time.perf_counter() - start
                self.busy_cpu += time.thread_time() - start_cpu
                self.conn.send("done")

        engine.scheduler.step = gated

    def clock(self, engine: Engine) -> float:
        """Seconds of gated steps so far, read once the engine's loop has finished its step in
        progress (a generation's results reach the caller before its last step returns)."""
        engine.get_server_info()
        self.readings.append((self.busy, self.busy_cpu))
        return self.busy


def measure_gated(
    gate: StepGate, engine: Engine, batch: int, args: argparse.Namespace, *call_args: Any
) -> dict:
    """measure, every scheduler step taking its turn and timed alone; with the prefill's and the
    generation's seconds also by the scheduler thread's CPU clock (`cpu_prefill_s`,
    `cpu_elapsed`)."""
    gate.on = True
    gate.readings.clear()
    try:
        out = measure(engine, batch, args, *call_args, clock=functools.partial(gate.clock, engine))
    finally:
        gate.on = False
    (_, prefill_0), (_, prefill_1), (_, start), (_, end) = gate.readings
    return {**out, "cpu_prefill_s": prefill_1 - prefill_0, "cpu_elapsed": end - start}


# What the parent may ask of the engine, each called as fn(engine, batch, args, *call_args);
# an engine opened with a gate also answers "measure_gated".
CALLS: Mapping[str, Callable] = {"warm_up": warm_up, "measure": measure}


def _serve(
    conn: Connection,
    path: str,
    kwargs: dict,
    batch: int,
    args: argparse.Namespace,
    gate_conn: Optional[Connection] = None,
) -> None:
    """The child: open the engine, report its weight bytes, then answer calls until told to stop
    (None); an exception goes back to the parent as its traceback."""
    try:
        with open_engine(path, kwargs, batch, args) as engine:
            calls = dict(CALLS)
            if gate_conn is not None:
                gate = StepGate(gate_conn)
                gate.install(engine)
                calls["measure_gated"] = functools.partial(measure_gated, gate)
            conn.send(("ok", engine.runner.weight_bytes()))
            while (request := conn.recv()) is not None:
                name, call_args = request
                try:
                    conn.send(("ok", calls[name](engine, batch, args, *call_args)))
                except Exception:
                    conn.send(("error", traceback.format_exc()))
    except Exception:
        conn.send(("error", traceback.format_exc()))


class EngineProcess:
    """open_engine(path, kwargs, batch, args) in a spawned process (`in_process`: in a thread of
    this one); `call` runs one of CALLS there and returns its result. `gated`: its scheduler steps
    wait for their turns in `drive` during "measure_gated"."""

    def __init__(
        self,
        path: str,
        kwargs: dict,
        batch: int,
        args: argparse.Namespace,
        gated: bool = False,
        in_process: bool = False,
    ) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self.gate, child_gate = ctx.Pipe() if gated else (None, None)
        serve = (child, path, kwargs, batch, args, child_gate)
        if in_process:  # a thread of this process serves it (--in-process): the pipes stay open
            self._proc = threading.Thread(target=_serve, args=serve, daemon=True)
            self._proc.start()
            self.pid = os.getpid()
        else:
            self._proc = ctx.Process(target=_serve, args=serve, daemon=True)
            self._proc.start()
            self.pid = self._proc.pid
            child.close()
            if child_gate is not None:
                child_gate.close()
        try:
            self.weight_bytes: int = self.answer()
        except RuntimeError:
            self.close()
            raise

    def call(self, name: str, *call_args: Any) -> Any:
        self.send(name, *call_args)
        return self.answer()

    def send(self, name: str, *call_args: Any) -> None:
        """Start a call; `answer` waits for its result."""
        known = [*CALLS, "measure_gated"] if self.gate is not None else list(CALLS)
        if name not in known:
            raise ValueError(f"no benchmark call {name!r}; one of {sorted(known)}")
        self._conn.send((name, call_args))

    @property
    def readers(self) -> list[Connection]:
        """What `drive` waits on: the gate (a step asks for its turn) and the answers."""
        return [self.gate, self._conn]

    def answered(self) -> bool:
        """Whether the call in progress has a result (or the process died)."""
        return self._conn.poll()

    def answer(self) -> Any:
        try:
            status, value = self._conn.recv()
        except EOFError:
            self._proc.join(timeout=10)
            raise RuntimeError(
                "the benchmark engine process died "
                f"(exit code {getattr(self._proc, 'exitcode', None)}); its stderr above says why"
            ) from None
        if status == "error":
            raise RuntimeError(f"in the benchmark engine process:\n{value}")
        return value

    def close(self) -> None:
        if self._proc.is_alive():
            self._conn.send(None)
            self._proc.join(timeout=60)
        if self._proc.is_alive() and not isinstance(self._proc, threading.Thread):
            self._proc.kill()
            self._proc.join()
        self._conn.close()
        if self.gate is not None:
            self.gate.close()

    def __enter__(self) -> EngineProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def drive(engines: Mapping[str, EngineProcess]) -> dict[str, Any]:
    """With a "measure_gated" call sent to each gated engine: one scheduler step each in turn,
    in order, until every engine answered; their answers by name."""
    answers: dict[str, Any] = {}
    while len(answers) < len(engines):
        for name, engine in engines.items():
            if name in answers:
                continue
            wait(engine.readers)  # it asks for a step, or has answered
            if engine.answered():
                answers[name] = engine.answer()
                continue
            try:
                engine.gate.recv()
                engine.gate.send("go")
                engine.gate.recv()
            except EOFError:
                answers[name] = engine.answer()  # raises with the reason it died
    return answers
