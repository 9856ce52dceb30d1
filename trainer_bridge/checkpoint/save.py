"""Writing a training checkpoint: every rank of the group writes its shards of model, optimizer and
RNG through megatron's dist_checkpointing (torch_dist), synchronously, with no helper process."""

from __future__ import annotations

import queue

from trainer_bridge.checkpoint.layout import TrainActor, state_dict


def save_checkpoint(actor: TrainActor, directory: str, rollout_id: int) -> None:
    """Every rank of the group writes its shards of model, optimizer and RNG into `directory`
    (created by the caller, on a filesystem all ranks share)."""
    from megatron.core import dist_checkpointing

    _in_process_results_queue()
    dist_checkpointing.save(state_dict(actor, rollout_id), directory)


def _in_process_results_queue() -> None:
    """megatron's torch_dist writer (FileSystemWriterAsync, also behind a synchronous save) hands
    its write results back through a queue built for asynchronous saves, whose writer runs in
    another process: a `spawn` multiprocessing Manager's queue, a helper process per rank that
    re-imports the rank's main module, started by the first save (measured on the 2-core VM: 1 s
    of CPU in a Ray trainer rank, 10 s where the main module imports torch and megatron).
    specrl saves synchronously, as Megatron-LM and slime do without --async-save (they still pay
    for that process): dist_checkpointing.save runs AsyncRequest.execute_sync, where the results
    are put and read in this process (the fork-context writers report on queues of their own), so
    an in-process queue is all it needs. An asynchronous save would need megatron's queue back."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if filesystem_async._results_queue is None:
        filesystem_async._results_queue = queue.Queue()
