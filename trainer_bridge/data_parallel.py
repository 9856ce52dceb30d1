"""One trainer rank's data-parallel side: its share of a batch's sequences and the reductions
over its data-parallel group (on the rank's device: NCCL reduces only CUDA tensors)."""

from __future__ import annotations

import torch
from torch import Tensor

from trainer_bridge.batch import TrainBatch


class DataParallel:
    """Rank `rank` of `size` data-parallel ranks (every rank of a tensor-parallel group has the
    same one)."""

    def __init__(self, size: int, rank: int, device: torch.device) -> None:
        self.size, self.rank, self.device = size, rank, device

    def share(self, batch: TrainBatch) -> tuple[TrainBatch, list[int]]:
        """This rank's sequences of `batch`, and their rows in it."""
        if self.size == 1:
            return batch, list(range(len(batch)))
        if len(batch) % self.size:
            raise ValueError(
                f"a batch of {len(batch)} sequences does not split over {self.size} data-parallel "
                "trainer ranks; make rollout-batch-size x n-samples-per-prompt a multiple of it"
            )
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
