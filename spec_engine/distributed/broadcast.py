"""Rank 0's decisions, sent to the other ranks: SGLang's `broadcast_pyobj` over the CPU group.

SGLang's scheduler receives requests on rank 0 and broadcasts them every loop iteration; an
empty list costs one 8-byte broadcast. Every rank calls this at the same point of its loop;
the others block until rank 0 sends. FP8 tensors (a weight update's float8_e4m3fn weights)
travel as their bytes: torch cannot unpickle what pickle makes of them ("UntypedStorage has no
attribute 'dtype'").
"""

from __future__ import annotations

import io
import pickle
from typing import Any

import torch

from spec_engine.distributed.parallel_state import TPGroup


class _Pickler(pickle.Pickler):
    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor) and obj.is_floating_point() and obj.element_size() == 1:
            return _from_bytes, (obj.view(torch.uint8), obj.dtype)
        return NotImplemented


def _from_bytes(data: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return data.view(dtype)


def _dumps(data: list[Any]) -> bytes:
    buffer = io.BytesIO()
    _Pickler(buffer).dump(data)
    return buffer.getvalue()


def broadcast_pyobj(data: list[Any], group: TPGroup, src: int = 0) -> list[Any]:
    """On `src`: send `data` (a list of picklable objects) and return it; elsewhere: return
    what `src` sent (`data` is ignored)."""
    if group.size == 1:
        return data
    pg = group.cpu_group
    size = torch.zeros(1, dtype=torch.int64, device="cpu")
    if group.rank == src:
        payload = _dumps(data) if data else b""
        size[0] = len(payload)
        pg.broadcast(size, src).wait()
        if payload:
            pg.broadcast(torch.frombuffer(bytearray(payload), dtype=torch.uint8), src).wait()
        return data
    pg.broadcast(size, src).wait()
    if int(size.item()) == 0:
        return []
    buffer = torch.empty(int(size.item()), dtype=torch.uint8, device="cpu")
    pg.broadcast(buffer, src).wait()
    return pickle.loads(buffer.numpy().tobytes())
