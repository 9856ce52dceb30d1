"""One host-to-device copy for a step's small inputs.

A step's inputs are a dozen short arrays built on the host (token ids, positions, sequence
lengths, the requests' table rows, KV slots, sampling parameters). `torch.tensor(values,
device=cuda)` copies each from pageable memory: the driver stages it through a bounce buffer,
synchronously with the host, a copy call per array. `upload` packs a step's arrays into one
pinned buffer (8-byte aligned parts, each in its own dtype) and sends it with one non-blocking
copy; the parts are views of the device copy. PyTorch's pinned-memory cache keeps the buffer
until the copy has run (it records the copy's stream), so the next step's buffer never
overwrites one still in flight. On the CPU the packed buffer is the parts' storage: the step
runs the same code, without the copy.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Union

import numpy as np
import torch

Values = Union[Sequence[int], Sequence[float], np.ndarray]

_ALIGN = 8
_NUMPY = {
    torch.int64: np.int64,
    torch.int32: np.int32,
    torch.float32: np.float32,
    torch.float64: np.float64,
    torch.bool: np.bool_,
}


def upload(device: torch.device, *parts: tuple[Values, torch.dtype]) -> list[torch.Tensor]:
    """Each (values, dtype) part as a 1-D tensor on `device`, all sent in one copy."""
    arrays = []
    for values, dtype in parts:
        if dtype not in _NUMPY:
            raise ValueError(f"upload takes {sorted(map(str, _NUMPY))}, not {dtype}")
        arrays.append(np.asarray(values, dtype=_NUMPY[dtype]).reshape(-1))
    offsets, total = [], 0
    for a in arrays:
        offsets.append(total)
        total += -(-a.nbytes // _ALIGN) * _ALIGN
    packed = np.zeros(max(total, _ALIGN), dtype=np.uint8)
    for a, start in zip(arrays, offsets):
        packed[start : start + a.nbytes] = a.view(np.uint8)
    host = torch.from_numpy(packed)
    if device.type == "cpu":
        sent = host
    else:
        staged = torch.empty(
            host.shape, dtype=torch.uint8, device="cpu", pin_memory=device.type == "cuda"
        )
        sent = staged.copy_(host).to(device, non_blocking=device.type == "cuda")
    return [
        sent[start : start + a.nbytes].view(dtype)
        for a, start, (_, dtype) in zip(arrays, offsets, parts)
    ]
