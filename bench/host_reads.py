"""Host reads: the tensor-to-host calls an engine step makes on the scheduler's thread.

On a GPU every read of a device tensor's values (`item`, `tolist`, `int(t)`, `nonzero`, ...)
waits for the queued kernels: the step stalls until the device catches up, and the host cannot
prepare the next launch meanwhile. The CPU path runs the same step code, so counting these calls
on a CPU engine counts the syncs a CUDA engine makes (issue #44): `HostReads` wraps the methods
on `torch.Tensor` while it is entered and counts the calls made on one thread, with the project
line that made each; `StepReads` attributes them to the engine's scheduler steps.

What counts: `item`, `tolist`, `cpu`, `numpy`, `nonzero` (method or `torch.nonzero`: its output
size is data dependent), `bool()`, `int()`, `float()` and `operator.index()` of a tensor, and
`.to` a CPU device from another device. A read of a host tensor counts too (on CPU the counter
cannot tell a host tensor from a device one): step code keeps host values as Python numbers.
Not seen: syncs inside a kernel call (boolean-mask indexing, `repeat_interleave` without
`output_size`, `torch.unique`), which the step code avoids.
"""

from __future__ import annotations

import collections
import functools
import os
import sys
import threading
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


@dataclass
class StepRecord:
    """One scheduler step: what it ran and the host reads it made."""

    kind: str  # "prefill", "plain" (a decode at depth 0 / a plain worker) or "spec"
    batch: int  # requests decoded (prefill: admitted)
    reads: int
    sites: collections.Counter = field(default_factory=collections.Counter)


class StepReads:
    """Host reads per scheduler step of one engine: wraps its scheduler's `step` (and its
    worker's `decode`, to know each step's depth) on the instance while entered."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.steps: list[StepRecord] = []
        self.reads = HostReads(engine._thread.ident)

    def __enter__(self) -> StepReads:
        sched = self.engine.scheduler
        worker, reads = sched.worker, self.reads
        step, decode, prefill = sched.step, worker.decode, worker.prefill
        seen: dict[str, Any] = {}

        def counted_decode(reqs: Any, *depth: Any) -> Any:
            spec = hasattr(worker, "shapes") and depth != (0,)
            seen.setdefault("kind", "spec" if spec else "plain")
            seen["batch"] = seen.get("batch", 0) + len(reqs)
            return decode(reqs, *depth)

        def counted_prefill(reqs: Any) -> Any:
            seen.update(kind="prefill", batch=len(reqs))
            return prefill(reqs)

        def counted_step() -> None:
            seen.clear()
            reads.take()
            step()
            count, sites = reads.take()
            if seen:
                self.steps.append(StepRecord(seen["kind"], seen["batch"], count, sites))

        sched.step, worker.decode, worker.prefill = counted_step, counted_decode, counted_prefill
        reads.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.reads.__exit__(*exc)
        sched = self.engine.scheduler
        for obj, name in ((sched, "step"), (sched.worker, "decode"), (sched.worker, "prefill")):
            obj.__dict__.pop(name, None)

    def decode_steps(self, kind: Optional[str] = None) -> list[StepRecord]:
        return [s for s in self.steps if s.kind != "prefill" and kind in (None, s.kind)]


def worst(steps: list[StepRecord]) -> Iterator[str]:
    """The reads of the step that made the most, one line per site."""
    if not steps:
        return iter(())
    step = max(steps, key=lambda s: s.reads)
    return (f"{n} x {method} at {site}" for (method, site), n in step.sites.most_common())
