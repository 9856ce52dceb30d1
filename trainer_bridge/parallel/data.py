"""One trainer rank's data-parallel side: its share of a batch's sequences and the reductions
over its data-parallel group (on the rank's device: NCCL reduces only CUDA tensors).

The share is a contiguous run of the batch, or with --balance-data as many sequences as every
other rank's, chosen so that the ranks' token counts are close: Karmarkar-Karp's largest
differencing method with equal counts, the algorithm of slime's get_seqlen_balanced_partitions
(from verl) with its own tie-breaking, applied to the sequences as slime did before its May 2026
rewrite (which balances micro batches' estimated FLOPs instead).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence

import torch
from torch import Tensor

from trainer_bridge.batch import TrainBatch


class DataParallel:
    """Rank `rank` of `size` data-parallel ranks (every rank of a tensor-parallel group has the
    same one)."""

    def __init__(
        self, size: int, rank: int, device: torch.device, balance_data: bool = False
    ) -> None:
        self.size, self.rank, self.device = size, rank, device
        self.balance_data = balance_data

    def share(self, batch: TrainBatch) -> tuple[TrainBatch, list[int]]:
        """This rank's sequences of `batch`, and their rows in it (ascending)."""
        if self.size == 1:
            return batch, list(range(len(batch)))
        if len(batch) % self.size:
            raise ValueError(
                f"a batch of {len(batch)} sequences does not split over {self.size} data-parallel "
                "trainer ranks; make rollout-batch-size x n-samples-per-prompt a multiple of it"
            )
        if self.balance_data:
            rows = balanced_partitions([len(t) for t in batch.tokens], self.size)[self.rank]
        else:
            per = len(batch) // self.size
            rows = list(range(self.rank * per, (self.rank + 1) * per))
        return batch.select(rows), rows

    def all_reduce(self, tensor: Tensor, op: str = "sum") -> None:
        """`tensor` summed (or `op` "max") over the data-parallel ranks, in place."""
        if self.size > 1:
            from megatron.core import parallel_state

            reduce_op = {
                "sum": torch.distributed.ReduceOp.SUM,
                "max": torch.distributed.ReduceOp.MAX,
            }
            torch.distributed.all_reduce(
                tensor, op=reduce_op[op], group=parallel_state.get_data_parallel_group()
            )

    def max(self, count: int) -> int:
        """The largest `count` over the data-parallel ranks."""
        if self.size == 1:
            return count
        t = torch.tensor([count], dtype=torch.long, device=self.device)
        self.all_reduce(t, "max")
        return int(t.item())

    def mean(self, values: dict[str, float]) -> dict[str, float]:
        """Metrics averaged over the data-parallel ranks (each saw its share of the sequences)."""
        if self.size == 1 or not values:
            return values
        keys = sorted(values)
        # float64 keeps sums of many metrics exact.
        t = torch.tensor([values[k] for k in keys], dtype=torch.float64, device=self.device)
        self.all_reduce(t)
        return {k: v / self.size for k, v in zip(keys, t.tolist())}


def balanced_partitions(lengths: Sequence[int], parts: int) -> list[list[int]]:
    """The indices of `lengths` in `parts` groups of equal size (len(lengths) a multiple of
    `parts`) whose sums are close, each ascending: Karmarkar-Karp's largest differencing method.
    The sequences, shortest first, are dealt `parts` at a time into partial partitions; the two
    partial partitions whose sums spread most are merged, largest group with smallest, until
    one is left."""
    if len(lengths) % parts:
        raise ValueError(f"{len(lengths)} sequences do not split into {parts} equal groups")
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    tie = itertools.count()  # equal spreads merge in the order they were made

    def entry(groups: list[tuple[int, list[int]]]) -> tuple[int, int, list]:
        groups.sort(key=lambda g: (-g[0], g[1]))
        return (-(groups[0][0] - groups[-1][0]), next(tie), groups)

    heap = [
        entry([(lengths[i], [i]) for i in order[start : start + parts]])
        for start in range(0, len(order), parts)
    ]
    heapq.heapify(heap)
    while len(heap) > 1:
        _, _, a = heapq.heappop(heap)
        _, _, b = heapq.heappop(heap)
        merged = [(sa + sb, ia + ib) for (sa, ia), (sb, ib) in zip(a, reversed(b))]
        heapq.heappush(heap, entry(merged))
    return sorted(sorted(items) for _, items in heap[0][2])
