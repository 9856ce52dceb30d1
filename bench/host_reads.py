"""Host reads: the tensor-to-host calls an engine step makes on the scheduler's thread.

On a GPU every read of a device tensor's values (`item`, `tolist`, `int(t)`, `nonzero`, ...)
waits for the queued kernels: the step stalls until the device catches up, and the host cannot
prepare the next launch meanwhile. The CPU path runs the same step code, so counting these calls
on a CPU engine counts the syncs a CUDA engine makes (issue #44): `HostReads` wraps the methods
on `torch.Tensor` while it is entered and counts the calls made on one thread, with the project
line that made each; `StepReads` attributes them to the engine's scheduler steps. `StepTimes`
measures each step's host CPU time instead.

What counts: `item`, `tolist`, `cpu`, `numpy`, `nonzero` (method or `torch.nonzero`: its output
size is data dependent), `bool()`, `int()`, `float()` and `operator.index()` of a tensor, and
`.to` a CPU device from another device. A read of a host tensor counts too (on CPU the counter
cannot tell a host tensor from a device one): step code keeps host values as Python numbers.
Not seen: syncs inside a kernel call (boolean-mask indexing, `repeat_interleave` without
`output_size`, `torch.unique`), which the step code avoids.
"""

from __future__ import annotations

import collections
import cProfile
import functools
import io
import os
import pstats
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

# Tensor methods that hand a tensor's values to the host.
READ_METHODS = (
    "item",
    "tolist",
    "cpu",
    "numpy",
    "nonzero",
    "__bool__",
    "__int__",
    "__float__",
    "__index__",
)
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_PACKAGES = tuple(
    os.path.join(_ROOT, p) + os.sep for p in ("spec_engine", "bench", "tests", "rollout")
)


def _site() -> str:
    """The innermost project line on the stack (file:line), outside this module."""
    frame = sys._getframe(2)
    here = os.path.abspath(__file__)
    while frame is not None:
        path = os.path.abspath(frame.f_code.co_filename)
        if path != here and path.startswith(_PACKAGES):
            return f"{os.path.relpath(path, _ROOT)}:{frame.f_lineno} ({frame.f_code.co_name})"
        frame = frame.f_back
    return "?"


def _to_host(tensor: torch.Tensor, args: tuple, kwargs: dict) -> bool:
    """Whether `tensor.to(*args, **kwargs)` copies from another device to the host."""
    if tensor.device.type == "cpu":
        return False
    target = kwargs.get("device")
    for a in args:
        if isinstance(a, (str, torch.device)):
            target = a
        elif isinstance(a, torch.Tensor):
            target = a.device
    return target is not None and torch.device(target).type == "cpu"


class HostReads:
    """Counts host reads made on one thread while entered (`thread`: its ident; None: the
    entering thread; settable while entered). `sites` counts them per (method, project line)."""

    def __init__(self, thread: Optional[int] = None) -> None:
        self.thread = thread
        self.count = 0
        self.sites: collections.Counter = collections.Counter()
        self._saved: list[tuple[Any, str, Any]] = []
        self._lock = threading.Lock()

    def _record(self, method: str) -> None:
        if threading.get_ident() != self.thread:
            return
        with self._lock:
            self.count += 1
            self.sites[(method, _site())] += 1

    def _wrap(self, owner: Any, name: str, test: Optional[Callable] = None) -> None:
        original = getattr(owner, name)

        @functools.wraps(original)
        def counted(*args: Any, **kwargs: Any) -> Any:
            if test is None or test(*args, **kwargs):
                self._record(name)
            return original(*args, **kwargs)

        self._saved.append((owner, name, original))
        setattr(owner, name, counted)

    def __enter__(self) -> HostReads:
        if self.thread is None:
            self.thread = threading.get_ident()
        for name in READ_METHODS:
            self._wrap(torch.Tensor, name)
        self._wrap(torch, "nonzero")
        self._wrap(torch.Tensor, "to", lambda t, *a, **k: _to_host(t, a, k))
        return self

    def __exit__(self, *exc: Any) -> None:
        for owner, name, original in reversed(self._saved):
            setattr(owner, name, original)
        self._saved = []

    def take(self) -> tuple[int, collections.Counter]:
        """The reads since the last take (count, sites), and start counting afresh."""
        with self._lock:
            taken = self.count, self.sites
            self.count, self.sites = 0, collections.Counter()
        return taken


# torch functions that make a tensor from host data (on a GPU, a copy from the host).
FROM_HOST = ("tensor", "as_tensor", "from_numpy")
_UPLOAD = os.path.join(_ROOT, "spec_engine", "mem", "upload.py")


class HostCopies(HostReads):
    """Counts tensors made from host data on one thread while entered (`torch.tensor`,
    `torch.as_tensor`, `torch.from_numpy`), with the project line of each; those that
    spec_engine/mem/upload.py makes (one per `upload`: a step's arrays in one pinned copy) count
    as ("upload", its caller's line), every other as a stray pageable copy."""

    def __enter__(self) -> HostCopies:
        if self.thread is None:
            self.thread = threading.get_ident()
        for name in FROM_HOST:
            self._wrap(torch, name)
        return self

    def _record(self, method: str) -> None:
        if threading.get_ident() != self.thread:
            return
        frame = sys._getframe(2)  # the torch function's caller (_record <- counted <- it)
        if os.path.abspath(frame.f_code.co_filename) == _UPLOAD:
            method, frame = "upload", frame.f_back
        while frame is not None and not os.path.abspath(frame.f_code.co_filename).startswith(
            _PACKAGES
        ):
            frame = frame.f_back
        site = "?"
        if frame is not None:
            path = os.path.relpath(os.path.abspath(frame.f_code.co_filename), _ROOT)
            site = f"{path}:{frame.f_lineno} ({frame.f_code.co_name})"
        with self._lock:
            self.count += 1
            self.sites[(method, site)] += 1


@dataclass
class StepRecord:
    """One scheduler step: what it ran and the host reads it made."""

    kind: str  # "prefill", "plain" (a decode at depth 0 / a plain worker) or "spec"
    batch: int  # requests decoded (prefill: admitted)
    reads: int
    sites: collections.Counter = field(default_factory=collections.Counter)


def _wrap_steps(engine: Any, around: Callable[[Callable[[], None], dict], None]) -> None:
    """Wraps the engine's scheduler `step` on the instance: `around(step, seen)` runs each step;
    `seen` then holds its kind ("prefill", "plain", "spec") and batch, or nothing when it ran
    no batch. The worker's `decode`, `launch_decode` and `prefill` are wrapped too, to know each
    step's depth."""
    sched = engine.scheduler
    worker = sched.worker
    step, decode, prefill = sched.step, worker.decode, worker.prefill
    launch = worker.launch_decode
    seen: dict[str, Any] = {}

    def seen_decode(reqs: Any, *depth: Any) -> Any:
        spec = hasattr(worker, "shapes") and depth != (0,)
        seen.setdefault("kind", "spec" if spec else "plain")
        seen["batch"] = seen.get("batch", 0) + len(reqs)
        return decode(reqs, *depth)

    def seen_launch(reqs: Any, previous: Any = None) -> Any:
        """An overlapped step (core/overlap.py; a speculative worker's: a chain step,
        speculative/chain_overlap.py): it reads the step launched before it."""
        seen.setdefault("kind", "spec" if hasattr(worker, "shapes") else "plain")
        seen["batch"] = seen.get("batch", 0) + len(reqs)
        return launch(reqs, previous)

    def seen_prefill(reqs: Any) -> Any:
        seen.update(kind="prefill", batch=len(reqs))
        return prefill(reqs)

    def wrapped_step() -> None:
        seen.clear()
        around(step, seen)

    sched.step, worker.decode, worker.prefill = wrapped_step, seen_decode, seen_prefill
    worker.launch_decode = seen_launch


def _unwrap_steps(engine: Any) -> None:
    sched = engine.scheduler
    wrapped = ((sched, "step"), (sched.worker, "decode"), (sched.worker, "prefill"))
    for obj, name in (*wrapped, (sched.worker, "launch_decode")):
        obj.__dict__.pop(name, None)


class StepReads:
    """Host reads per scheduler step of one engine: wraps its scheduler's `step` (and its
    worker's `decode`, to know each step's depth) on the instance while entered."""

    def __init__(self, engine: Any, counter: type[HostReads] = HostReads) -> None:
        self.engine = engine
        self.steps: list[StepRecord] = []
        # `counter`: what a step's count counts (HostCopies: tensors made from host data).
        self.reads = counter(engine._thread.ident)

    def __enter__(self) -> StepReads:
        reads = self.reads

        def counted(step: Callable[[], None], seen: dict) -> None:
            reads.take()
            step()
            count, sites = reads.take()
            if seen:
                self.steps.append(StepRecord(seen["kind"], seen["batch"], count, sites))

        _wrap_steps(self.engine, counted)
        reads.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.reads.__exit__(*exc)
        _unwrap_steps(self.engine)

    def decode_steps(self, kind: Optional[str] = None) -> list[StepRecord]:
        return [s for s in self.steps if s.kind != "prefill" and kind in (None, s.kind)]


def worst(steps: list[StepRecord]) -> Iterator[str]:
    """The reads of the step that made the most, one line per site."""
    if not steps:
        return iter(())
    step = max(steps, key=lambda s: s.reads)
    return (f"{n} x {method} at {site}" for (method, site), n in step.sites.most_common())


class StepTimes:
    """Host CPU time of each decode step on the engine's scheduler thread (`time.thread_time`:
    the thread's own CPU time, so other processes taking the cores do not inflate it), and,
    with `profile`, a cProfile of those steps alone. Wraps the steps as `StepReads` does."""

    def __init__(self, engine: Any, profile: bool = False) -> None:
        self.engine = engine
        self.steps: list[tuple[str, int, float]] = []  # (kind, batch, seconds)
        # The thread's CPU clock, as for the step times: cProfile's default is wall time.
        self.profile = cProfile.Profile(time.thread_time) if profile else None

    def __enter__(self) -> StepTimes:
        profile = self.profile

        def timed(step: Callable[[], None], seen: dict) -> None:
            if profile is not None:
                profile.enable()
            start = time.thread_time()
            step()
            spent = time.thread_time() - start
            if profile is not None:
                profile.disable()
            if seen and seen["kind"] != "prefill":
                self.steps.append((seen["kind"], seen["batch"], spent))

        _wrap_steps(self.engine, timed)
        return self

    def __exit__(self, *exc: Any) -> None:
        _unwrap_steps(self.engine)

    def per_step(self, kind: str, batch: int) -> list[float]:
        """The host seconds of the decode steps of `kind` that ran `batch` requests."""
        return [s for k, b, s in self.steps if k == kind and b == batch]

    def top(self, sort: str, n: int = 25) -> str:
        """The profile's top `n` entries sorted by `sort` ("cumulative", "tottime")."""
        out = io.StringIO()
        pstats.Stats(self.profile, stream=out).sort_stats(sort).print_stats(n)
        return out.getvalue()
