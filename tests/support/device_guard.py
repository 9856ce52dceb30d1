"""DeviceGuard: a test mode that catches, on CPU, the tensors a GPU run would get wrong.

Project code (spec_engine, trainer_bridge, rollout, specrl, scripts) must name the device of
every tensor it creates: on a CPU-only machine an implicit device and the right one are the same,
so a forgotten `device=` passes every CPU test and breaks the first GPU run (a host tensor fed to
a CUDA kernel, a CPU buffer copied into graph memory, an NCCL reduction of a host tensor). Under
the guard, every factory call made directly from project code without `device=` is recorded
with its file and line, and so is a factory call that silently yields float64 (numpy data, say)
without `dtype=`. Library code (torch, transformers, megatron-core) is not judged.
"""

from __future__ import annotations

import pathlib
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

ROOT = pathlib.Path(__file__).resolve().parents[2]
PROJECT_DIRS = tuple(
    str(ROOT / d) + "/" for d in ("spec_engine", "trainer_bridge", "rollout", "specrl", "scripts")
)
TORCH_DIR = str(pathlib.Path(torch.__file__).resolve().parent) + "/"
# Calls that make a tensor on the default device unless told otherwise.
FACTORIES = {
    torch.tensor,
    torch.as_tensor,
    torch.zeros,
    torch.ones,
    torch.empty,
    torch.full,
    torch.arange,
    torch.linspace,
    torch.logspace,
    torch.eye,
    torch.rand,
    torch.randn,
    torch.randint,
    torch.randperm,
    torch.empty_strided,
    torch.scalar_tensor,
    torch.normal,
    torch.tril_indices,
    torch.triu_indices,
}


class DeviceGuard(TorchFunctionMode):
    """Records `file:line: torch.<factory>` for each offending call (a set: reported once)."""

    def __init__(self) -> None:
        super().__init__()
        self.implicit_device: set[str] = set()
        self.implicit_float64: set[str] = set()

    def __torch_function__(
        self, func: Any, types: Any, args: tuple = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func in FACTORIES:
            where = _project_caller()
            if where is not None:
                name = f"{where}: torch.{func.__name__}"
                keeps_device = (
                    func is torch.as_tensor and args and isinstance(args[0], torch.Tensor)
                )
                if "device" not in kwargs and not keeps_device:
                    self.implicit_device.add(name)
                if (
                    isinstance(out, torch.Tensor)
                    and out.dtype == torch.float64
                    and "dtype" not in kwargs
                ):
                    self.implicit_float64.add(name)
        return out

    @property
    def violations(self) -> list[str]:
        return sorted(f"implicit device: {v}" for v in self.implicit_device) + sorted(
            f"implicit float64: {v}" for v in self.implicit_float64
        )


def _project_caller() -> str | None:
    """`path:line` of the first caller outside torch and this file, if it is project code."""
    frame = sys._getframe(2)
    while frame is not None:
        path = frame.f_code.co_filename
        if not (path.startswith(TORCH_DIR) or path == __file__):
            if path.startswith(PROJECT_DIRS):
                return f"{pathlib.Path(path).relative_to(ROOT)}:{frame.f_lineno}"
            return None
        frame = frame.f_back
    return None


@contextmanager
def guarded_engine_threads(guard: DeviceGuard) -> Iterator[None]:
    """The guard in the calling thread and in every Engine's scheduler thread started meanwhile
    (torch function modes are per thread)."""
    from spec_engine.engine import Engine

    original = Engine._loop

    def loop(self: Engine) -> None:
        with guard:
            original(self)

    Engine._loop = loop
    try:
        with guard:
            yield
    finally:
        Engine._loop = original
