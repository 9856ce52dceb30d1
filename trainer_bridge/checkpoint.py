"""The policy's training checkpoint as megatron-core writes it: `dist_checkpointing` (torch_dist
backend), one directory per checkpoint, every rank writing its own shards.

The state dict follows Megatron-LM's `generate_state_dict` (megatron/training/checkpointing.py,
which megatron-core does not ship): `model` (the GPTModel, MTP layers included), `optimizer`
(Adam's moments and step, sharded like the parameters: `_optimizer_state`), `rng_state` (every
rank's Python, NumPy, torch and tracker states: one object per tensor-parallel rank holding the
list of its data-parallel replicas' states), `iteration` (the rollout id, as in slime),
`checkpoint_version`, and specrl's own `specrl` entry (the model's Hugging Face config, the tensor-,
expert- and expert tensor parallel sizes and the optimizer step count), which the launcher reads
back without megatron (`read_common`) to refuse a checkpoint of another model before anything
starts. Every tensor, Adam's moments included, is saved as megatron's sharded tensor of its
parameter (global shape, this rank's offsets), so a checkpoint resumes at another tensor-parallel
size too: dist_checkpointing reads each rank's slices of it (the vocabulary padded for another TP
size: megatron's `allow_shape_mismatch`, the padding rows zero). Under expert parallelism each rank
writes its own experts under their global numbers (megatron's SequentialMLP.sharded_state_dict),
their Adam state too, each expert's tensor sharded over the expert tensor parallel ranks (whole at
--expert-tensor-parallel-size 1): a checkpoint resumes at another expert-parallel and expert tensor
parallel size, each rank reading its experts (or its slices of them) back. With
--enable-draft-training, `draft` holds the draft trained online (EAGLE-2/3 or STANDALONE) and
its Adam state (trainer_bridge.drafts.online).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pickle
import random
import re
import threading
from collections.abc import Collection, Iterator
from typing import Any, Protocol

import numpy as np
import torch

from spec_engine.models.hf_config import ModelConfig
from trainer_bridge.model.checkpoint_names import match_saved_names
from trainer_bridge.options import TrainerArgs

logger = logging.getLogger(__name__)


class TrainActor(Protocol):
    """What a checkpoint reads and restores of trainer_bridge.actor.TrainActor (its importer)."""

    args: TrainerArgs
    arch: ModelConfig
    gpt: Any  # megatron's GPTModel
    optimizer: Any  # megatron's MegatronOptimizer
    online_draft: Any  # trainer_bridge.drafts.online.OnlineDraft or its stand-in
    dp_rank: int
    dp_size: int
    step: int


CHECKPOINT_VERSION = 3.0  # Megatron-LM's current checkpoint_version
COMMON_FILE = "common.pt"  # where dist_checkpointing keeps the non-sharded entries
FORMAT = "specrl-torch_dist-v2"
# v1 kept megatron's own optimizer layout: at EP 1 the same tensor keys and step as v2's, at EP > 1
# under the `chained_N.` prefixes of megatron's ChainedOptimizer, which v2 does not read.
V1_FORMAT = "specrl-torch_dist-v1"


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


def _set_rng_state(state: dict[str, Any]) -> None:
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
    if actor.dp_size == 1:
        return [obj]
    from megatron.core import parallel_state

    out: list[Any] = [None] * actor.dp_size
    torch.distributed.all_gather_object(
        out, obj, group=parallel_state.get_data_parallel_group(with_context_parallel=True)
    )
    return out


def _trained(actor: TrainActor) -> Iterator[tuple[str, Any, torch.Tensor, Any]]:
    """(name, model parameter, the tensor Adam updates, its torch optimizer) of each trained
    parameter; the tensor is the parameter, or under --bf16 megatron's float32 main copy."""
    inner = getattr(actor.optimizer, "chained_optimizers", [actor.optimizer])
    owner = {}
    for megatron_optimizer in inner:
        # Adam's zero moments where no step has run yet, as its first step makes them (its step
        # 0: `_optimizer_state`), so that a checkpoint holds every trained parameter's state.
        megatron_optimizer.init_state_fn(megatron_optimizer.optimizer, megatron_optimizer.config)
        for group in megatron_optimizer.optimizer.param_groups:
            owner.update((id(p), megatron_optimizer.optimizer) for p in group["params"])
    for name, param in actor.gpt.named_parameters():
        main = getattr(param, "main_param", param)
        if id(main) in owner:
            yield name, param, main, owner[id(main)]


def _optimizer_state(actor: TrainActor, model: dict[str, Any]) -> dict[str, Any]:
    """Adam's state of each trained parameter (by its name on this rank) as tensors sharded like
    the parameter (`optimizer.state.exp_avg.<its sharded key>`, experts' under their global
    numbers), and the step all parameters share.

    Megatron's own layout (MegatronOptimizer.sharded_state_dict) nests the state per optimizer of a
    ChainedOptimizer, two at EP > 1 (expert and other parameters) and one at EP 1, by position
    in each, with `chained_N.` key prefixes: a checkpoint of one EP size would not load at
    another. These keys are those of megatron's single optimizer at EP 1 (a v1 checkpoint's)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.optimizer import make_sharded_optimizer_tensor
    from megatron.core.dist_checkpointing.utils import extract_sharded_tensors_and_factories

    # As megatron's get_param_id_to_sharded_param_map: the sharded entry holding the parameter.
    sharded = {
        id(t.data): t for t in nested_values(extract_sharded_tensors_and_factories(model)[0])
    }
    state: dict[str, Any] = {}
    for name, param, main, optimizer in _trained(actor):
        adam = optimizer.state[main]
        step = _step(optimizer, adam)
        tensors = {k: v for k, v in adam.items() if k != "step"}
        if main is not param:
            tensors["fp32_param"] = main
        state[name] = {
            k: make_sharded_optimizer_tensor(sharded[id(param)], v, f"optimizer.state.{k}")
            for k, v in tensors.items()
        }
        # every parameter steps together (DDP gives each a gradient): one step, as megatron's
        # `common_step`, where v1 kept it
        state["common_step"] = step
    return {"state": state}


def _restore_optimizer(actor: TrainActor, loaded: dict[str, Any]) -> None:
    """Copy `_optimizer_state`'s loaded tensors and step into the optimizer. Its param groups
    stay this run's (learning rate, betas, weight decay: flags, with no schedule to resume)."""
    saved = loaded["state"]
    for name, _, main, optimizer in _trained(actor):
        adam = optimizer.state[main]
        for key, tensor in saved[name].items():
            (main.data if key == "fp32_param" else adam[key]).copy_(tensor)
        if _steps_in_groups(optimizer):
            for group in optimizer.param_groups:
                group["step"] = int(saved["common_step"].item())
        else:
            adam["step"] = saved["common_step"].clone()


def _steps_in_groups(optimizer: torch.optim.Optimizer) -> bool:
    """Whether `optimizer` counts steps per param group: TE's and Apex's FusedAdam (megatron's
    Adam where either is installed: GPUs) do, torch's Adam and AdamW count per parameter."""
    return not isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW)


def _step(optimizer: torch.optim.Optimizer, adam: dict[str, Any]) -> torch.Tensor:
    """The steps `optimizer` took, a float32 scalar on the CPU. Torch's Adam gets a step 0 where
    none ran (init_state_fn made the moments; torch adds no step to a non-empty state)."""
    if _steps_in_groups(optimizer):
        steps = {int(g.get("step", 0)) for g in optimizer.param_groups if g["params"]} or {0}
        if len(steps) > 1:  # every group steps together (megatron asserts it too)
            raise RuntimeError(f"the optimizer's param groups took different steps: {steps}")
        return torch.tensor(float(steps.pop()), dtype=torch.float32, device="cpu")
    return adam.setdefault("step", torch.zeros((), dtype=torch.float32, device="cpu"))


def _state_dict(
    actor: TrainActor, rollout_id: int, saved: Collection[str] | None = None
) -> dict[str, Any]:
    """What a checkpoint holds; `saved`: when loading, the checkpoint's keys (its norms may go by
    the local spec's names: trainer_bridge.model.checkpoint_names)."""
    loading = saved is not None
    model = actor.gpt.sharded_state_dict()
    if loading:
        _read_local_names(model, saved)
    rng = [None] * actor.dp_size if loading else _gather_dp(_rng_state(), actor)
    state = {
        "checkpoint_version": CHECKPOINT_VERSION,
        "iteration": rollout_id,
        "model": model,
        "optimizer": _optimizer_state(actor, model),
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
    dist_checkpointing.save(_state_dict(actor, rollout_id), directory)


def load_checkpoint(actor: TrainActor, directory: str) -> int:
    """Restore model, optimizer and RNG from `directory`, saved at any tensor-, expert- and
    expert tensor parallel size; returns its rollout id. The launcher has already checked the
    model (`check_common`); dist_checkpointing still refuses a tensor whose global shape
    differs."""
    from megatron.core import dist_checkpointing

    common = read_common(directory)
    args = actor.args
    check_common(common, actor.arch.hf_config, directory)
    meta = common["specrl"]
    saved_tp = meta["tensor_model_parallel_size"]
    saved = (
        saved_tp,
        meta.get("expert_model_parallel_size", 1),  # 1 from before EP
        meta.get("expert_tensor_parallel_size", saved_tp),  # from before ETP: TP
    )
    template = _state_dict(actor, common["iteration"], _saved_keys(directory))
    if saved_tp != args.tensor_model_parallel_size:
        # one RNG object per TP rank: at another TP size there is none of this rank's to read
        del template["rng_state"]
    state = dist_checkpointing.load(template, directory)
    actor.gpt.load_state_dict(state["model"])
    _restore_optimizer(actor, state["optimizer"])
    # A rank's RNG states come from seeds of its place in the layout (the tensor- and
    # expert-parallel trackers' from its TP, expert and expert tensor parallel ranks): at another
    # layout they are another rank's, so the run keeps those --seed gave it, as Megatron-LM does
    # at another TP size.
    states = state.get("rng_state", [])
    layout = (args.tensor_model_parallel_size, args.expert_model_parallel_size, args.expert_tp)
    if len(states) == actor.dp_size and saved == layout:
        _set_rng_state(states[actor.dp_rank])
    actor.step = meta["optimizer_step"]
    # A checkpoint of a run without --enable-draft-training has none: the draft starts from the
    # engines' draft checkpoint, as it did before.
    if "draft" in common:
        actor.online_draft.load_state_dict(common["draft"])
    return common["iteration"]


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
    _read_local_names(sharded, saved)
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


def _read_local_names(sharded: dict[str, Any], saved: set[str]) -> None:
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


def _saved_keys(directory: str) -> set[str]:
    from torch.distributed.checkpoint import FileSystemReader

    return set(FileSystemReader(directory).read_metadata().state_dict_metadata)


def _load_common(directory: str) -> Any:
    """common.pt's entries. Megatron-LM's hold its args (a Namespace) and enums, which torch's
    weights-only loading refuses until megatron.core registers them (on import), so a checkpoint
    of specrl's is read without importing megatron."""
    path = os.path.join(directory, COMMON_FILE)
    try:
        try:
            return torch.load(path, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError:
            import megatron.core  # noqa: F401

            return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # a truncated file: the message names it
        raise ValueError(f"{path} cannot be read ({e}); the checkpoint is corrupt") from e


def check_megatron_model(directory: str, hf_config: dict[str, Any]) -> None:
    """Refuse a Megatron-LM checkpoint of another model than --hf-checkpoint's: its hidden size,
    layers, dense MLP width, routed experts and (padded) vocabulary, read from its tensors' global
    shapes. Megatron stacks the layers of a model whose layers are alike under `decoder.layers.*`
    (the layer first in every shape) and keeps each layer under its own number,
    `decoder.layers.<i>.*`, where dense and MoE layers mix (DeepSeek-V3's and GLM-4.5's first
    dense layers)."""
    from torch.distributed.checkpoint import FileSystemReader

    shapes = {
        key: tuple(meta.size)
        for key, meta in FileSystemReader(directory).read_metadata().state_dict_metadata.items()
        if hasattr(meta, "size")
    }
    arch = ModelConfig.load(hf_config)

    def per_layer(name: str) -> dict[int, tuple[int, ...]]:
        """Layer number -> shape of one layer's tensor `name`, stacked or numbered."""
        if (stacked := shapes.get(f"decoder.layers.{name}")) is not None:
            return {i: stacked[1:] for i in range(stacked[0])}
        pattern = re.compile(rf"decoder\.layers\.(\d+)\.{re.escape(name)}")
        return {int(m[1]): shape for key, shape in shapes.items() if (m := pattern.fullmatch(key))}

    embedding = shapes.get("embedding.word_embeddings.weight")
    layers = per_layer("self_attention.linear_proj.weight")
    if embedding is None or not layers:
        raise ValueError(
            f"{directory} holds no GPT model's embedding and decoder layers (megatron torch_dist "
            "keys embedding.word_embeddings.weight, decoder.layers.*); point --ref-load at a "
            "checkpoint of the policy's model"
        )
    # gate and up projections stacked in a dense MLP's linear_fc1; a router's rows, its experts
    dense = {shape[0] // 2 for shape in per_layer("mlp.linear_fc1.weight").values()}
    experts = {shape[0] for shape in per_layer("mlp.router.weight").values()}
    found = {
        "hidden size": embedding[1],
        "layers": len(layers),
        "intermediate size": dense or None,
        "routed experts": experts or None,
    }
    wanted = {
        "hidden size": arch.hidden_size,
        "layers": arch.num_hidden_layers,
        "intermediate size": {arch.intermediate_size} if dense else None,
        "routed experts": {arch.moe.num_experts} if arch.moe else None,
    }

    def shown(value: Any) -> Any:
        return next(iter(value)) if isinstance(value, set) and len(value) == 1 else value

    diffs = [
        f"{name} {shown(found[name])} vs {shown(wanted[name])}"
        for name in found
        if found[name] != wanted[name]
    ]
    if embedding[0] < arch.vocab_size:
        diffs.append(f"vocabulary {embedding[0]} vs at least {arch.vocab_size}")
    if diffs:
        raise ValueError(
            f"{directory} holds another model than --hf-checkpoint ({', '.join(diffs)}); point "
            "--ref-load at a checkpoint of the policy's model"
        )


def read_common(directory: str, megatron_lm: bool = False) -> dict[str, Any] | None:
    """The non-sharded entries of a checkpoint (iteration, specrl's metadata). Raises ValueError
    naming the directory when it is not one of these checkpoints; with `megatron_lm`, one written
    by Megatron-LM (slime's --save or torch_dist conversion: no specrl entry) gives None."""
    path = os.path.join(directory, COMMON_FILE)
    if not os.path.isfile(path):
        raise ValueError(
            f"{directory} is not a complete megatron checkpoint (no {COMMON_FILE}): it was cut "
            "short or is not a checkpoint; point --load at a directory with "
            "latest_checkpointed_iteration.txt, or remove it"
        )
    common = _load_common(directory)
    meta = common.get("specrl") if isinstance(common, dict) else None
    if megatron_lm and meta is None:
        return None
    if not isinstance(meta, dict) or meta.get("format") not in (FORMAT, V1_FORMAT):
        raise ValueError(
            f"{directory} was not written by specrl's --save (no {FORMAT!r} entry in "
            f"{COMMON_FILE}); a Megatron-LM (slime) checkpoint is read as --ref-load only: start "
            "from its Hugging Face export with --hf-checkpoint instead"
        )
    return common


def check_same_model(
    saved_config: dict[str, Any], hf_config: dict[str, Any], directory: str, fix: str
) -> None:
    """Refuse weights (Hugging Face config `saved_config`, in `directory`) of another model shape
    than --hf-checkpoint's `hf_config`, naming what differs and `fix`."""
    from trainer_bridge.model.provider import read_model_config

    saved, wanted = read_model_config(saved_config), read_model_config(hf_config)
    if saved != wanted:
        diffs = [
            f"{f.name} {getattr(saved, f.name)} vs {getattr(wanted, f.name)}"
            for f in dataclasses.fields(saved)
            if f.compare and getattr(saved, f.name) != getattr(wanted, f.name)
        ]
        raise ValueError(
            f"{directory} holds another model than --hf-checkpoint ({', '.join(diffs)}); {fix}"
        )


def check_common(common: dict[str, Any], hf_config: dict[str, Any], directory: str) -> None:
    """Refuse a checkpoint of another model shape, or one this version cannot read, saying what
    to do (any tensor-, expert- and expert tensor parallel size resumes)."""
    meta = common["specrl"]
    check_same_model(
        meta["hf_config"],
        hf_config,
        directory,
        "pass the --hf-checkpoint the run started from, or a checkpoint of this model",
    )
    saved_ep = meta.get("expert_model_parallel_size", 1)  # 1 from before EP
    if meta["format"] == V1_FORMAT and saved_ep > 1:
        raise ValueError(
            f"{directory} was written by an older specrl ({V1_FORMAT}) at "
            f"--expert-model-parallel-size {saved_ep}, whose Adam state is laid out per "
            "expert-parallel size (megatron's chained optimizers), which this version does not "
            "read: resume it with the specrl that wrote it, or start a new run from its Hugging "
            "Face export (--save-hf) as --hf-checkpoint"
        )
