"""The tensor-parallel group: a rank's place in its engine and the collectives its layers run.

SGLang's parallel_state keeps one TP group per process; here one process may hold several
engines (rank 0 of an engine lives in the caller's process, beside engines of other sizes), so
a model takes the group in effect while it is built (`use_tp_group`) and its layers keep it.
Two process groups per engine, as SGLang's `GroupCoordinator`: the device group for the model's
tensors (NCCL on CUDA, gloo on CPU) and a gloo group on the CPU for Python objects (rank 0's
decisions, `broadcast.broadcast_pyobj`). Both are private to the engine (`ProcessGroupGloo`
over the engine's own TCPStore): the caller's default process group, if any, is untouched.
"""

from __future__ import annotations

import contextlib
import contextvars
import pickle
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Optional

import torch
import torch.distributed as dist


@dataclass(frozen=True, eq=False)
class TPGroup:
    """Rank `rank` of `size`; at size 1 every collective is the identity and no group exists.
    `ep_size` (--ep-size, a divisor of `size`): how a MoE layer places its routed experts on the
    ranks (partition.expert_place, layers/moe.py)."""

    rank: int = 0
    size: int = 1
    device_group: Any = None  # ProcessGroup over the model's tensors
    cpu_group: Any = None  # gloo ProcessGroup over CPU tensors (Python objects)
    ep_size: int = 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the ranks, in place (every rank gets the same bits: each element's sum
        is computed once and sent to the others)."""
        if self.size > 1:
            self.device_group.allreduce(x).wait()
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's `x`, concatenated along the last dimension in rank order."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        self.device_group.allgather(parts, x.contiguous()).wait()
        return torch.cat(parts, dim=-1)

    def min(self, value: int) -> int:
        """The smallest of the ranks' `value`s (what every rank can afford, e.g. KV slots)."""
        if self.size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64, device="cpu")
        self.cpu_group.allreduce(t, dist.ReduceOp.MIN).wait()
        return int(t.item())

    def gather_objects(self, obj: Any) -> list[Any]:
        """Every rank's picklable `obj`, in rank order, on every rank."""
        if self.size == 1:
            return [obj]
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        size = torch.tensor([data.numel()], dtype=torch.int64, device="cpu")
        sizes = [torch.empty_like(size) for _ in range(self.size)]
        self.cpu_group.allgather(sizes, size).wait()
        longest = int(max(s.item() for s in sizes))
        padded = torch.zeros(longest, dtype=torch.uint8, device="cpu")
        padded[: data.numel()] = data
        parts = [torch.empty_like(padded) for _ in range(self.size)]
        self.cpu_group.allgather(parts, padded).wait()
        return [pickle.loads(p[: int(s.item())].numpy().tobytes()) for p, s in zip(parts, sizes)]


SINGLE = TPGroup()
_CURRENT: contextvars.ContextVar[TPGroup] = contextvars.ContextVar("tp_group", default=SINGLE)


def get_tp_group() -> TPGroup:
    """The group a model being built belongs to (SINGLE outside `use_tp_group`)."""
    return _CURRENT.get()


@contextlib.contextmanager
def use_tp_group(group: TPGroup) -> Iterator[TPGroup]:
    """Build models for `group` inside this block (their layers keep it)."""
    token = _CURRENT.set(group)
    try:
        yield group
    finally:
        _CURRENT.reset(token)


def connect(
    store: Any, rank: int, size: int, device: torch.device, timeout: Optional[timedelta]
) -> TPGroup:
    """Rank `rank` of an engine's TP group over `store` (every rank calls this, once). On CUDA
    the device group is NCCL on this process's current device, else it is the gloo group."""
    timeout = timeout or timedelta(minutes=30)  # torch's default for process groups
    cpu = dist.ProcessGroupGloo(dist.PrefixStore("tp_cpu", store), rank, size, timeout)
    device_group = cpu
    if device.type == "cuda":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        device_group = dist.ProcessGroupNCCL(
            dist.PrefixStore("tp_nccl", store), rank, size, options
        )
    return TPGroup(rank, size, device_group, cpu)
