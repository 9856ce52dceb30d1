"""One host read for a step's small results.

On a GPU each read of a device tensor's values waits for every queued kernel; a step that reads
its tokens, then its NaN flags, then its log-probs waits several times, and the host prepares
nothing meanwhile. `read_back` copies several small tensors in one read: each is flattened and
cast to float64 (exact for the integers a step reads, below 2**53, for float32 and for bools),
concatenated, read once, and split again into Python lists of the parts' own kinds.
"""

from __future__ import annotations

from typing import Optional

import torch


def read_back(*parts: Optional[torch.Tensor]) -> list[Optional[list]]:
    """Each part's values as a flat Python list (ints for integer and bool parts, floats for
    floating ones), read in one copy; None parts stay None."""
    real = [p for p in parts if p is not None]
    if not real:
        return [None for _ in parts]
    flat = torch.cat([p.reshape(-1).to(torch.float64) for p in real])
    values = flat.tolist()  # the one read
    out: list[Optional[list]] = []
    start = 0
    for p in parts:
        if p is None:
            out.append(None)
            continue
        n = p.numel()
        chunk = values[start : start + n]
        start += n
        out.append(chunk if p.is_floating_point() else [int(v) for v in chunk])
    return out
