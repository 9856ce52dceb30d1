"""Writing a training checkpoint: every rank of the group writes its shards of model, optimizer and
RNG through megatron's dist_checkpointing (torch_dist), whose writer process can be started early
so the first save does not wait for it."""

from __future__ import annotations

import threading

from trainer_bridge.checkpoint.layout import TrainActor, state_dict

_warming: threading.Thread | None = None


def warm_writer() -> None:
    """The torch_dist writer's first save starts a helper process (a `spawn` multiprocessing
    Manager, which re-imports the caller's main module: seconds on CPU, ~8 s in a test process);
    starting it in a thread while the run starts up keeps that off the first save."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    global _warming
    if _warming is None:
        _warming = threading.Thread(
            target=filesystem_async._get_write_results_queue, name="warm-ckpt-writer", daemon=True
        )
        _warming.start()


def save_checkpoint(actor: TrainActor, directory: str, rollout_id: int) -> None:
    """Every rank of the group writes its shards of model, optimizer and RNG into `directory`
    (created by the caller, on a filesystem all ranks share)."""
    from megatron.core import dist_checkpointing

    if _warming is not None:
        _warming.join()  # one writer process, not a second one started beside it
    dist_checkpointing.save(state_dict(actor, rollout_id), directory)
