"""Capturing a forward as a replayable graph: a CUDA graph on CUDA, an emulation on CPU.

A captured graph replays the kernels it recorded, on the tensors it recorded them on. Three
things therefore break one silently: work that needs the host during capture (a `.item()`,
a tensor built from Python data, an output whose shape depends on values), Python values read
at capture that change later (they stay baked in), and tensors replaced after capture (a
KV pool reallocated, weights moved back in): the graph keeps reading the old memory.

Without CUDA, `EmulatedGraph` runs the same closure eagerly on the same static tensors and
makes the hazards fail loudly on CPU: `CaptureGuard` refuses host syncs and value-dependent
shapes, and replays call the closure captured with the
static batch, whose Python fields keep their capture-time values exactly as in a CUDA graph.
With `check_inputs` (--cuda-graph-self-check), capture runs under the guard and every replay
checks that the closure still reads the tensors it read at capture (the third hazard).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

Outputs = Sequence[Optional[torch.Tensor]]

_aten = torch.ops.aten
# Ops that read a value back to the host, or whose output shape depends on tensor values.
_HOST_SYNC = {
    _aten.item.default,
    _aten._local_scalar_dense.default,
    _aten.is_nonzero.default,
    _aten.nonzero.default,
    _aten.masked_select.default,
    _aten.unique_dim.default,
    _aten._unique2.default,
    _aten.unique_consecutive.default,
    _aten.repeat_interleave.Tensor,
    _aten.repeat_interleave.self_Tensor,
    # torch.tensor(python data): a host-to-device copy on CUDA, and a value frozen at capture
    _aten.lift_fresh.default,
}


class CaptureError(RuntimeError):
    pass


def _storage(t: torch.Tensor) -> Optional[int]:
    """The storage address of a strided tensor (None for layouts without one, e.g. oneDNN-packed
    CPU weights, which exist only on CPU and are never captured on CUDA)."""
    if t.layout is not torch.strided:
        return None
    return t.untyped_storage().data_ptr()


class CaptureGuard(TorchDispatchMode):
    """Refuses, naming the op, what a CUDA graph cannot capture; records the storages the
    closure reads that it did not create (its external inputs)."""

    def __init__(self, label: str, refuse: bool = True) -> None:
        super().__init__()
        self.label, self.refuse = label, refuse
        self.created: set[int] = set()
        self.inputs: set[int] = set()

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None
    ) -> Any:
        kwargs = kwargs or {}
        if self.refuse:
            bad = func in _HOST_SYNC or (
                func in (_aten.index.Tensor, _aten.index_put.default, _aten.index_put_.default)
                and any(
                    isinstance(i, torch.Tensor) and i.dtype == torch.bool
                    for i in (args[1] or ())
                    if i is not None
                )
            )
            if bad:
                raise CaptureError(
                    f"{self.label}: {func} cannot be captured in a CUDA graph (it needs the host "
                    "or has a value-dependent shape); move it out of the captured forward"
                )
        for t in tree_flatten((args, kwargs))[0]:
            if isinstance(t, torch.Tensor):
                s = _storage(t)
                if s is not None and s not in self.created:
                    self.inputs.add(s)
        out = func(*args, **kwargs)
        for t in tree_flatten(out)[0]:
            if (
                isinstance(t, torch.Tensor)
                and (s := _storage(t)) is not None
                and s not in self.inputs
            ):
                self.created.add(s)
        return out


class EmulatedGraph:
    """The CPU stand-in for a CUDA graph: the closure, rerun at replay; with `check_inputs`
    (--cuda-graph-self-check) checked for capture hazards at capture and for replaced inputs at
    every replay."""

    def __init__(self, fn: Callable[[], Outputs], label: str, check_inputs: bool) -> None:
        self.fn, self.label, self.check_inputs = fn, label, check_inputs
        self.inputs: set[int] = set()
        if (
            check_inputs
        ):  # costs two forwards per size at startup: only with --cuda-graph-self-check
            fn()  # warm-up, as before a CUDA capture: lazily built tables exist from here on
            guard = CaptureGuard(label)
            with guard:
                fn()
            self.inputs = guard.inputs

    def replay(self) -> Outputs:
        if not self.check_inputs:
            return self.fn()
        guard = CaptureGuard(self.label, refuse=False)
        with guard:
            out = self.fn()
        if guard.inputs != self.inputs:
            raise CaptureError(
                f"{self.label}: the captured forward now reads {len(guard.inputs - self.inputs)} "
                "tensor(s) it did not read at capture; a real CUDA graph would read the old "
                "memory. "
                "Tensors a graph reads must be updated in place, or the graphs recaptured"
            )
        return out


class CudaGraph:
    """A torch.cuda.CUDAGraph of the closure, in the shared memory pool; outputs are static."""

    def __init__(self, fn: Callable[[], Outputs], pool: Any) -> None:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(
            stream
        ):  # warm-up: lazy inits (cuBLAS workspaces) happen outside capture
            for _ in range(2):
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.outputs = fn()

    def replay(self) -> Outputs:
        self.graph.replay()
        return self.outputs


def capture(
    fn: Callable[[], Outputs], label: str, device: torch.device, pool: Any, check_inputs: bool
) -> CudaGraph | EmulatedGraph:
    """A CUDA graph of `fn` on CUDA (in `pool`), else its CPU emulation."""
    if device.type == "cuda":
        return CudaGraph(fn, pool)
    return EmulatedGraph(fn, label, check_inputs)


def new_pool(device: torch.device) -> Any:
    """One memory pool for every graph of an engine (None on CPU, where nothing is captured)."""
    return torch.cuda.graph_pool_handle() if device.type == "cuda" else None
