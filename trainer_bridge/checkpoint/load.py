"""Reading a training checkpoint back: a resumed run's model, optimizer and RNG (at any tensor-,
expert- and expert tensor parallel size), and --ref-load's model weights, from one of specrl's
checkpoints, a Megatron-LM (slime torch_dist) one, an hf-to-mcore output or a Hugging Face
directory."""

from __future__ import annotations

import logging
import os
from typing import Any

from trainer_bridge.checkpoint.common import COMMON_FILE, check_common, read_common
from trainer_bridge.checkpoint.layout import (
    TrainActor,
    read_local_names,
    set_rng_state,
    state_dict,
)
from trainer_bridge.checkpoint.optimizer import restore_optimizer

logger = logging.getLogger(__name__)


def load_checkpoint(actor: TrainActor, directory: str) -> int:
    """Restore model, optimizer and RNG from `directory`, saved at any tensor-, expert- and
    expert tensor parallel size; returns its rollout id. The launcher has already checked the
    model (`check_common`); dist_checkpointing still refuses a tensor whose global shape
    differs."""
    from megatron.core import dist_checkpointing

    common = read_common(directory)
    check_common(common, actor.arch.hf_config, directory)
    meta = common["specrl"]
    template = state_dict(actor, common["iteration"], _saved_keys(directory))
    if meta["tensor_model_parallel_size"] != actor.args.tensor_model_parallel_size:
        # one RNG object per TP rank: at another TP size there is none of this rank's to read
        del template["rng_state"]
    state = dist_checkpointing.load(template, directory)
    actor.gpt.load_state_dict(state["model"])
    restore_optimizer(actor, state["optimizer"])
    _restore_rng(actor, meta, state.get("rng_state", []))
    actor.step = meta["optimizer_step"]
    # A checkpoint of a run without --enable-draft-training has none: the draft starts from the
    # engines' draft checkpoint, as it did before.
    if "draft" in common:
        actor.online_draft.load_state_dict(common["draft"])
    return common["iteration"]


def _restore_rng(actor: TrainActor, meta: dict[str, Any], states: list[Any]) -> None:
    """This rank's RNG states from a checkpoint of the same layout. A rank's RNG states come from
    seeds of its place in the layout (the tensor- and expert-parallel trackers' from its TP,
    expert and expert tensor parallel ranks): at another layout they are another rank's, so the
    run keeps those --seed gave it, as Megatron-LM does at another TP size."""
    args = actor.args
    saved_tp = meta["tensor_model_parallel_size"]
    saved = (
        saved_tp,
        meta.get("expert_model_parallel_size", 1),  # 1 from before EP
        meta.get("expert_tensor_parallel_size", saved_tp),  # from before ETP: TP
    )
    layout = (args.tensor_model_parallel_size, args.expert_model_parallel_size, args.expert_tp)
    if len(states) == actor.dp_size and saved == layout:
        set_rng_state(states[actor.dp_rank])


def load_reference(gpt: Any, directory: str) -> None:
    """--ref-load, resolved by the launcher to a directory: the model part of one of these
    checkpoints or of a Megatron-LM one (slime's torch_dist; optimizer and RNG are not read), an
    hf-to-mcore output or a Hugging Face checkpoint. A megatron checkpoint without MTP layers
    (slime's converter run without --mtp-num-layers) leaves `gpt`'s as they are (the
    --hf-checkpoint's next-n layers)."""
    if not os.path.isfile(os.path.join(directory, COMMON_FILE)):
        from trainer_bridge.convert import load_hf_weights

        load_hf_weights(gpt, directory)
        return
    from megatron.core import dist_checkpointing

    sharded = gpt.sharded_state_dict()
    saved = _saved_keys(directory)
    read_local_names(sharded, saved)
    kept = [name for name in sharded if name.startswith("mtp.")]
    if kept and any(key.startswith("mtp.") for key in saved):
        kept = []
    if kept:
        logger.warning(
            "%s holds no MTP layers: the policy's %d MTP tensors stay --hf-checkpoint's (convert "
            "with --mtp-num-layers to carry them)",
            directory,
            len(kept),
        )
        sharded = {name: t for name, t in sharded.items() if name not in kept}
    state = dist_checkpointing.load({"model": sharded}, directory)
    missing = gpt.load_state_dict(state["model"], strict=not kept).missing_keys
    if any(not name.startswith("mtp.") for name in missing):
        raise ValueError(f"{directory} lacks {missing}; point --ref-load at the policy's model")


def _saved_keys(directory: str) -> set[str]:
    """The keys of the tensors and objects a torch_dist checkpoint holds (its metadata)."""
    from torch.distributed.checkpoint import FileSystemReader

    return set(FileSystemReader(directory).read_metadata().state_dict_metadata)
