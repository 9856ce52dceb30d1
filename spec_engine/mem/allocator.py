"""Page allocator for KV slots.

Slots are grouped in pages of `page_size`; slot s belongs to page s // page_size, and a
request's token at position p always sits at a slot with s % page_size == p % page_size, so a
request fills its last page before taking a new one. Page 0 is the reserved dummy page.

Slots are handed out on the host and the device at once (`Slots`): the host copy serves the
bookkeeping (frees, the request-to-token table's host mirror), so a decode step never reads a
device tensor back to learn which slots it holds.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple, Optional, Union

import numpy as np
import torch

from spec_engine.mem.upload import upload


class Slots(NamedTuple):
    """KV slots, the same values on the host (bookkeeping) and on the device (kernels)."""

    host: np.ndarray  # int64
    device: torch.Tensor  # int64


class PageAllocator:
    def __init__(self, num_tokens: int, page_size: int, device: torch.device) -> None:
        if num_tokens < page_size:
            raise ValueError(
                f"KV pool of {num_tokens} tokens is smaller than one page ({page_size})"
            )
        self.page_size = page_size
        self.num_pages = num_tokens // page_size
        self.device = device
        self.reset()

    def reset(self) -> None:
        # Pages 1..num_pages; popped from the end, so low pages are used first.
        self._free = list(range(self.num_pages, 0, -1))

    @property
    def total_tokens(self) -> int:
        return self.num_pages * self.page_size

    def available_size(self) -> int:
        """Free tokens (whole free pages)."""
        return len(self._free) * self.page_size

    def pages_needed(self, start_lens: Sequence[int], end_lens: Sequence[int]) -> int:
        p = self.page_size
        return sum(-(-end // p) - (-(-start // p)) for start, end in zip(start_lens, end_lens))

    def alloc(
        self, start_lens: Sequence[int], end_lens: Sequence[int], last_slots: Sequence[int]
    ) -> Optional[torch.Tensor]:
        """`alloc_slots`' device slots."""
        slots = self.alloc_slots(start_lens, end_lens, last_slots)
        return None if slots is None else slots.device

    def alloc_slots(
        self, start_lens: Sequence[int], end_lens: Sequence[int], last_slots: Sequence[int]
    ) -> Optional[Slots]:
        """Slots for positions [start, end) of each request, concatenated; None if out of pages.

        `last_slots[i]` is the slot of position start-1 (ignored when start is page-aligned).
        """
        p = self.page_size
        needed = self.pages_needed(start_lens, end_lens)
        if needed > len(self._free):
            return None
        if p == 1:
            total = sum(end - start for start, end in zip(start_lens, end_lens))
            slots = self._free[len(self._free) - total :]
            del self._free[len(self._free) - total :]
            return self._slots(slots)
        out: list[int] = []
        for start, end, last in zip(start_lens, end_lens, last_slots):
            pos = start
            if pos % p:
                # Continue the partly filled last page.
                fill = min(end, pos + p - pos % p)
                out.extend(range(last + 1, last + 1 + fill - pos))
                pos = fill
            while pos < end:
                page = self._free.pop()
                n = min(p, end - pos)
                out.extend(range(page * p, page * p + n))
                pos += n
        return self._slots(out)

    def _slots(self, values: list[int]) -> Slots:
        host = np.asarray(values, dtype=np.int64)
        return Slots(host, upload(self.device, (host, torch.int64))[0])

    def free(self, slots: Union[torch.Tensor, np.ndarray]) -> None:
        """Free the pages that hold `slots`; the slots must cover whole pages from page starts
        (a request's tail page counts as whole: nobody else holds its unused slots). Host slots
        (a numpy array) cost no read; a device tensor (a prefix-cache node's) is read back."""
        if len(slots) == 0:
            return
        if isinstance(slots, torch.Tensor):
            slots = np.asarray(slots.tolist(), dtype=np.int64)
        if self.page_size == 1:
            self._free.extend(slots.tolist())
        else:
            self._free.extend(np.unique(slots // self.page_size).tolist())
