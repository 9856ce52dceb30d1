"""The CUDA-graph self-check (--cuda-graph-self-check): every captured size replayed with a
padded synthetic batch and compared with the eager forward, before the engine serves."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

import torch

from spec_engine.forward_batch import ForwardBatch, ForwardMode
from spec_engine.mem.allocator import PageAllocator
from spec_engine.mem.kv_pool import KVPool, ReqToTokenPool
from spec_engine.runner.graph_runner import ForwardFn, GraphRunner


def self_check_tolerance(dtype: torch.dtype) -> tuple[float, float]:
    """(atol, rtol) between a padded replay and the eager forward, which differ only in reduction
    order (other matmul shapes): float32 agrees to ~1e-6; bfloat16/float16 to a few units in the
    last place of the largest output, so the bound grows with the outputs' magnitude (logits of a
    real model reach tens, where one bfloat16 step is 0.125)."""
    return (1e-3, 1e-4) if dtype == torch.float32 else (5e-2, 3e-2)


class SelfCheckBatches:
    """Synthetic batches for the startup self-check, over freshly allocated KV slots: every
    request reads two shared context slots holding random K/V and writes slots of its own.
    Runs before any request exists (all table rows and slots are free); close() gives them back."""

    CONTEXT = 2

    def __init__(
        self,
        table: ReqToTokenPool,
        allocator: PageAllocator,
        pools: Sequence[KVPool],
        vocab_size: int,
        device: torch.device,
    ) -> None:
        self.table, self.allocator, self.vocab_size, self.device = (
            table,
            allocator,
            vocab_size,
            device,
        )
        self.dtype = pools[0].dtype  # the model's: draft features are fed to it as they are
        self.gen = torch.Generator(device="cpu").manual_seed(0)
        self._slots: list[torch.Tensor] = []
        self._rows: set[int] = set()
        self.context = self._alloc(self.CONTEXT)
        for pool in pools:
            for buf in pool.buffers():
                # Drawn on the host (the generator is a CPU one), then moved into the pool.
                values = torch.randn(buf[self.context].shape, generator=self.gen, device="cpu")
                buf[self.context] = values.to(device=buf.device, dtype=buf.dtype)

    def make(
        self, g: GraphRunner, num: int, feature_dim: Optional[int], kv_rows: bool = False
    ) -> tuple[ForwardBatch, Optional[torch.Tensor]]:
        """A batch of `num` requests for `g`'s mode; `kv_rows`: draft-step rows that carry their
        own KV indices instead of a table row."""
        batch, tokens = self._extend(g, num) if g.extend else self._one_token(g, num, kv_rows)
        features = None
        if feature_dim is not None:
            features = torch.randn(tokens, feature_dim, generator=self.gen, device="cpu")
            features = features.to(device=self.device, dtype=self.dtype)
        return batch, features

    def _extend(self, g: GraphRunner, num: int) -> tuple[ForwardBatch, int]:
        """An extend-shaped batch (draft extend, or a tree verify with random tree masks)."""
        c = self.CONTEXT
        q = max(g.width - 1, 1)  # one short of the width, so token padding runs as well
        own = self._alloc(num * q).view(num, q)
        rows = self._table_rows(num, own)
        masks = None
        if g.mode is ForwardMode.TARGET_VERIFY:
            # A tree: each query sees the context, itself and a random subset of earlier nodes.
            tree = torch.rand(q, q, generator=self.gen, device="cpu") < 0.5
            eye = torch.eye(q, dtype=torch.bool, device="cpu")
            tree = (tree.tril(-1) | eye).to(self.device)
            masks = [
                torch.cat((torch.ones(q, c, dtype=torch.bool, device=self.device), tree), 1)
            ] * num
        batch = ForwardBatch(
            mode=g.mode,
            input_ids=self._ids(num * q),
            positions=torch.arange(c, c + q, device=self.device).repeat(num),
            out_cache_loc=own.reshape(-1),
            req_pool_indices=rows,
            seq_lens=torch.full((num,), c + q, device=self.device),
            seq_lens_cpu=[c + q] * num,
            extend_seq_lens_cpu=[q] * num,
            extend_prefix_lens_cpu=[c] * num,
            custom_masks=masks,
            logits_indices=None
            if masks is not None
            else torch.arange(q - 1, num * q, q, device=self.device),
        )
        return batch, num * q

    def _one_token(self, g: GraphRunner, num: int, kv_rows: bool) -> tuple[ForwardBatch, int]:
        """A batch of one token per row: `num` requests x the stage's width (decode, draft)."""
        c = self.CONTEXT
        n = num * g.width
        own = self._alloc(n)
        kv_idx = kv_ok = None
        if kv_rows:
            kv_idx = torch.cat((self.context.expand(n, c), own[:, None]), 1)
            kv_ok = torch.ones(n, c + 1, dtype=torch.bool, device=self.device)
            rows = torch.full((n,), g.dummy_row, dtype=torch.int64, device=self.device)
        else:
            rows = self._table_rows(n, own[:, None])
        batch = ForwardBatch(
            mode=g.mode,
            input_ids=self._ids(n),
            positions=torch.full((n,), c, device=self.device),
            out_cache_loc=own,
            req_pool_indices=rows,
            seq_lens=torch.full((n,), c + 1, device=self.device),
            seq_lens_cpu=[c + 1] * n,
            kv_indices=kv_idx,
            kv_mask=kv_ok,
        )
        return batch, n

    def close(self) -> None:
        for row in self._rows:
            self.table.req_to_token[row].zero_()
        for slots in self._slots:
            self.allocator.free(slots)
        self._slots, self._rows = [], set()

    def _alloc(self, n: int) -> torch.Tensor:
        slots = self.allocator.alloc([0], [n], [0])
        if slots is None:
            raise ValueError(
                f"--cuda-graph-self-check needs {n} free KV slots for its test batches; raise "
                "--max-total-tokens or lower the largest --cuda-graph-bs size"
            )
        self._slots.append(slots)
        return slots

    def _table_rows(self, n: int, own: torch.Tensor) -> torch.Tensor:
        if n > self.table.size:
            raise ValueError(
                f"--cuda-graph-self-check needs {n} request rows; lower the largest "
                "--cuda-graph-bs "
                f"size to --max-running-requests ({self.table.size}) or below"
            )
        for row in range(n):
            self.table.write(row, 0, torch.cat((self.context, own[row])))
            self._rows.add(row)
        return torch.arange(n, device=self.device)

    def _ids(self, n: int) -> torch.Tensor:
        ids = torch.randint(self.vocab_size, (n,), generator=self.gen, device="cpu")
        return ids.to(self.device)


def self_check(
    runners: Sequence[GraphRunner],
    forward: ForwardFn,
    batches: SelfCheckBatches,
    tolerance: tuple[float, float],
) -> None:
    """Replay every size of every runner on a synthetic batch one request short of it (padding
    runs) and compare with the eager forward; raise naming the size and mode on a mismatch
    (--cuda-graph-self-check at startup). Gives the batches' slots and rows back at the end."""
    try:
        for g in runners:
            for size in g.sizes:
                num = size - 1 if g.padding and size > 1 else size
                batch, features = batches.make(g, num, g.feature_dim, g.kv_rows)
                eager = forward(batch, features)
                replayed = g.run(batch, features, size=size)
                for name, want, got in zip(("logits", "features"), eager, replayed):
                    err, bound = mismatch(want, got, tolerance)
                    if not err <= bound:
                        raise RuntimeError(
                            f"CUDA-graph self-check failed: {g.label} at batch size {size} "
                            f"({num} real requests) differs from eager in {name} by {err:.3g} "
                            f"(tolerance {bound:.3g}); run with --disable-cuda-graph and report "
                            "this"
                        )
    finally:
        batches.close()


def mismatch(
    want: torch.Tensor, got: torch.Tensor, tolerance: tuple[float, float]
) -> tuple[float, float]:
    """(largest difference, the bound it must stay within): atol + rtol * the largest |want|."""
    atol, rtol = tolerance
    want, got = want.float(), got.float()
    err = (got - want).abs().max().item()
    return err, atol + rtol * want.abs().max().item()
