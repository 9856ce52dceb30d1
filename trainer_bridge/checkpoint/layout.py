"""What a checkpoint holds (Megatron-LM's `generate_state_dict` layout, see the package's
docstring): the state dict the save writes and the load fills, and this rank's RNG states in it.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Collection
from typing import Any, Protocol

import numpy as np
import torch

from spec_engine.models.hf_config import ModelConfig
from trainer_bridge.checkpoint.common import FORMAT
from trainer_bridge.checkpoint.optimizer import Trainer, optimizer_state
from trainer_bridge.model.checkpoint_names import match_saved_names
from trainer_bridge.options import TrainerArgs

logger = logging.getLogger(__name__)

CHECKPOINT_VERSION = 3.0  # Megatron-LM's current checkpoint_version


class TrainActor(Trainer, Protocol):
    """What a checkpoint reads and restores of trainer_bridge.actor.TrainActor (which calls this
    package, so it is described here rather than imported): the policy and its optimizer
    (checkpoint.optimizer.Trainer's), and the following."""

    args: TrainerArgs
    arch: ModelConfig
    online_draft: Any  # trainer_bridge.drafts.online.OnlineDraft or its stand-in
    dp_rank: int
    dp_size: int
    step: int


def state_dict(
    actor: TrainActor, rollout_id: int, saved: Collection[str] | None = None
) -> dict[str, Any]:
    """What a checkpoint holds: to save (this rank's RNG states gathered over its data-parallel
    replicas), or given `saved`, a checkpoint's keys, a template for dist_checkpointing.load to
    fill (its RNG objects empty; its norms renamed where the checkpoint has the local spec's names
    for them: read_local_names)."""
    loading = saved is not None
    model = actor.gpt.sharded_state_dict()
    if loading:
        read_local_names(model, saved)
    rng = [None] * actor.dp_size if loading else _gather_dp(_rng_state(), actor)
    state = {
        "checkpoint_version": CHECKPOINT_VERSION,
        "iteration": rollout_id,
        "model": model,
        # after the renaming above: the optimizer's keys follow the model's
        "optimizer": optimizer_state(actor, model),
        "rng_state": _rng_sharded_object(actor, rng),
        "specrl": {
            "format": FORMAT,
            "hf_config": dict(actor.arch.hf_config),
            "tensor_model_parallel_size": actor.args.tensor_model_parallel_size,
            "expert_model_parallel_size": actor.args.expert_model_parallel_size,
            "expert_tensor_parallel_size": actor.args.expert_tp,
            "optimizer_step": actor.step,
        },
    }
    draft = actor.online_draft.state_dict()
    if draft is not None:
        state["draft"] = draft
    return state


def read_local_names(sharded: dict[str, Any], saved: Collection[str]) -> None:
    """Match the model's sharded state dict `sharded` (Transformer Engine's norm names) to a
    checkpoint's keys `saved`: norms it names as megatron's local layer spec does are read under
    those names, `_extra_state` objects it lacks (written without TE) are left out
    (trainer_bridge.model.checkpoint_names.match_saved_names); logs what it changed."""
    renamed, dropped = match_saved_names(sharded, saved)
    if renamed:
        logger.info(
            "the checkpoint names %d norm weights as megatron's local layer spec does (%s, ...): "
            "read under those names",
            len(renamed),
            renamed[0],
        )
    if dropped:
        logger.info(
            "the checkpoint holds no `_extra_state` of %d modules that Transformer Engine's "
            "have (%s, ...; written without TE): they load without it",
            len(dropped),
            dropped[0],
        )


def _rng_state() -> dict[str, Any]:
    """This rank's RNG states, under Megatron-LM's names."""
    from megatron.core import tensor_parallel

    state = {
        "random_rng_state": random.getstate(),
        "np_rng_state": np.random.get_state(),
        "torch_rng_state": torch.get_rng_state(),
        "rng_tracker_states": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }
    if torch.cuda.is_available():
        state["cuda_rng_state"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore this rank's RNG states from `_rng_state`'s dict."""
    from megatron.core import tensor_parallel

    random.setstate(state["random_rng_state"])
    np.random.set_state(state["np_rng_state"])
    torch.set_rng_state(state["torch_rng_state"])
    if torch.cuda.is_available() and "cuda_rng_state" in state:
        torch.cuda.set_rng_state(state["cuda_rng_state"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["rng_tracker_states"])


def _rng_sharded_object(actor: TrainActor, states: list[dict[str, Any]]) -> Any:
    """Megatron-LM's layout: one object per (pipeline, tensor) rank, replicated over data
    parallelism, holding the data-parallel ranks' states in rank order."""
    from megatron.core import parallel_state
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    tp = actor.args.tensor_model_parallel_size
    return ShardedObject(
        "rng_state",
        states,
        (1, tp),
        (0, parallel_state.get_tensor_model_parallel_rank()),
        replica_id=actor.dp_rank,
    )


def _gather_dp(obj: Any, actor: TrainActor) -> list[Any]:
    """`obj` of every data-parallel replica of this rank, in data-parallel rank order."""
    if actor.dp_size == 1:
        return [obj]
    from megatron.core import parallel_state

    out: list[Any] = [None] * actor.dp_size
    torch.distributed.all_gather_object(
        out, obj, group=parallel_state.get_data_parallel_group(with_context_parallel=True)
    )
    return out
