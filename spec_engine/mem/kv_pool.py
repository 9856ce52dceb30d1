"""KV storage: the per-layer K/V slot buffers and the request-to-token table (with its host
mirror)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Optional

import numpy as np
import torch

from spec_engine.mem.upload import upload


class KVPool:
    """K and V buffers per layer, shape [num_slots, num_kv_heads, head_dim].

    Page 0 (slots 0..page_size-1) is reserved: padded rows write there and masked reads
    point there, so it is kept zero-initialised and never handed to a request.
    """

    def __init__(
        self,
        num_tokens: int,
        page_size: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.num_tokens = num_tokens
        self.page_size = page_size
        self.dtype = dtype
        self.device = device
        self.shape = (num_tokens + page_size, num_kv_heads, head_dim)
        self.num_layers = num_layers
        self.allocate()

    def allocate(self) -> None:
        # torch.empty: slots are always written before they are read, and on CPU an untouched
        # allocation costs no RAM, so a generous pool is free until it is used.
        self.k_buffer = [
            torch.empty(self.shape, dtype=self.dtype, device=self.device)
            for _ in range(self.num_layers)
        ]
        self.v_buffer = [
            torch.empty(self.shape, dtype=self.dtype, device=self.device)
            for _ in range(self.num_layers)
        ]
        for buf in self.k_buffer + self.v_buffer:
            buf[: self.page_size].zero_()

    def release(self) -> None:
        """Free the buffers (resume_memory_occupation calls allocate again)."""
        self.k_buffer, self.v_buffer = [], []

    # K and V written by one fused kernel when layers/fused.install gives the pool one
    # (`store_kernel(k_buffer, v_buffer, loc, k, v)`); MLA's single latent buffer takes none.
    appends_kv = True
    store_kernel: Optional[Callable[..., None]] = None

    def set_kv(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        if self.store_kernel is not None:
            self.store_kernel(self.k_buffer[layer_id], self.v_buffer[layer_id], loc, k, v)
            return
        self.k_buffer[layer_id].index_copy_(0, loc, k.to(self.dtype))
        self.v_buffer[layer_id].index_copy_(0, loc, v.to(self.dtype))

    def buffers(self) -> list[torch.Tensor]:
        """Every distinct storage buffer (what copying or filling whole slots must touch once)."""
        return self.k_buffer + self.v_buffer

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers())


class MLAKVPool(KVPool):
    """The latent cache of MLA models (SGLang's MLATokenToKVPool): per layer one buffer
    [num_slots, 1, latent + rope key]. The values are the latent itself, so `v_buffer` holds
    views of its leading `v_dim` columns: no second copy is stored."""

    appends_kv = False  # one buffer: set_kv is a single copy already

    def __init__(
        self,
        num_tokens: int,
        page_size: int,
        num_layers: int,
        cache_dim: int,
        v_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.v_dim = v_dim
        super().__init__(num_tokens, page_size, num_layers, 1, cache_dim, dtype, device)

    def allocate(self) -> None:
        self.k_buffer = [
            torch.empty(self.shape, dtype=self.dtype, device=self.device)
            for _ in range(self.num_layers)
        ]
        for buf in self.k_buffer:
            buf[: self.page_size].zero_()
        self.v_buffer = [buf[..., : self.v_dim] for buf in self.k_buffer]

    def set_kv(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        # v is k's latent part (the caller passes that view), already written with k.
        self.k_buffer[layer_id].index_copy_(0, loc, k.to(self.dtype))

    def buffers(self) -> list[torch.Tensor]:
        # v_buffer views k_buffer: copying slots through both would copy twice, and a chain of
        # overlapping moves (speculative/base.py) would then read already-moved rows.
        return list(self.k_buffer)


class ReqToTokenPool:
    """Row r holds the KV slot of every token position of the request that owns row r.

    Row `dummy_row` (after the `size` request rows) is never handed out and stays all zeros:
    padded batch rows read through it, so they see only the dummy slot 0.

    `host` mirrors the table on the host, for bookkeeping (which slots to free, the last slot of
    a page): reading the device table back would make a decode step wait for the device. Writes
    pass their slots' host values where they have them (fresh allocations: mem.allocator.Slots);
    others (a cached prefix's slots, at admission) are read back once. np.zeros: pages of the
    mirror that no request reaches cost no memory.
    """

    def __init__(self, size: int, max_context_len: int, device: torch.device) -> None:
        self.size = size
        self.dummy_row = size
        self.max_context_len = max_context_len
        self.req_to_token = torch.zeros(
            (size + 1, max_context_len), dtype=torch.int32, device=device
        )
        self.host = np.zeros((size + 1, max_context_len), dtype=np.int32)
        self.reset()

    def reset(self) -> None:
        self._free_rows = list(range(self.size))

    def available_size(self) -> int:
        return len(self._free_rows)

    def alloc(self) -> int:
        if not self._free_rows:
            raise RuntimeError(
                "request-to-token table is full; this is a scheduler bug (admission must check "
                "rows)"
            )
        return self._free_rows.pop()

    def free(self, row: int) -> None:
        self._free_rows.append(row)

    def write(
        self, row: int, start: int, slots: torch.Tensor, host: Optional[np.ndarray] = None
    ) -> None:
        """`slots` (with `host`, their values on the host; None: read them back) at positions
        start, start + 1, ... of `row`."""
        end = start + len(slots)
        self.req_to_token[row, start:end] = slots.to(torch.int32)
        self.host[row, start:end] = _host_values(slots, host)

    def read(self, row: int, end: int, start: int = 0) -> torch.Tensor:
        return self.req_to_token[row, start:end].to(torch.int64)

    def read_host(self, row: int, end: int, start: int = 0) -> np.ndarray:
        """`read` from the host mirror (int64), without a device read."""
        return self.host[row, start:end].astype(np.int64)

    def read_ranges(
        self, rows: Sequence[int], starts: Sequence[int], ends: Sequence[int]
    ) -> torch.Tensor:
        """`read` of many rows in one gather: the slots of positions starts[i] .. ends[i] - 1 of
        row rows[i], concatenated (per-row reads cost a kernel each: host time on a GPU)."""
        index = self._device_cells(*_cells(rows, starts, ends))
        return self.req_to_token[index[0], index[1]].to(torch.int64)

    def read_ranges_host(
        self, rows: Sequence[int], starts: Sequence[int], ends: Sequence[int]
    ) -> np.ndarray:
        """`read_ranges` from the host mirror (int64)."""
        cell_rows, cell_cols = _cells(rows, starts, ends)
        return self.host[cell_rows, cell_cols].astype(np.int64)

    def write_ranges(
        self,
        rows: Sequence[int],
        starts: Sequence[int],
        ends: Sequence[int],
        slots: torch.Tensor,
        host: Optional[np.ndarray] = None,
    ) -> None:
        """`write` of many rows in one scatter: `slots` (`host`: as for `write`) holds each
        range's slots in turn."""
        cells = _cells(rows, starts, ends)
        index = self._device_cells(*cells)
        self.req_to_token[index[0], index[1]] = slots.to(torch.int32)
        self.host[cells] = _host_values(slots, host)

    def _device_cells(
        self, cell_rows: np.ndarray, cell_cols: np.ndarray
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows, positions) of the cells on the table's device, in one copy."""
        rows, cols = upload(
            self.req_to_token.device, (cell_rows, torch.int64), (cell_cols, torch.int64)
        )
        return rows, cols


def _cells(
    rows: Sequence[int], starts: Sequence[int], ends: Sequence[int]
) -> tuple[np.ndarray, np.ndarray]:
    """(row, position) of every cell of the ranges, built on the host."""
    starts_np = np.asarray(starts, dtype=np.int64)
    lens = np.asarray(ends, dtype=np.int64) - starts_np
    first = starts_np - (np.cumsum(lens) - lens)
    cols = np.arange(int(lens.sum()), dtype=np.int64) + np.repeat(first, lens)
    return np.repeat(np.asarray(rows, dtype=np.int64), lens), cols


def _host_values(slots: torch.Tensor, host: Optional[np.ndarray]) -> np.ndarray:
    """`host`, or the slots read back (one read, at admission: a cached prefix's slots)."""
    return host if host is not None else np.asarray(slots.tolist(), dtype=np.int64)
