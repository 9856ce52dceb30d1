"""Adam's state in a checkpoint, and back into the optimizer.

Each trained parameter's moments (and, under --bf16, megatron's float32 main copy of it) are saved
as tensors sharded like the parameter, under its name on this rank, so they resume at another
tensor-, expert- and expert tensor parallel size as the parameters do; the step count, which every
parameter shares, is saved once.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol

import torch


class Trainer(Protocol):
    """What Adam's state is read from and restored into: trainer_bridge.actor.TrainActor's policy
    and optimizer."""

    gpt: Any  # megatron's GPTModel
    optimizer: Any  # megatron's MegatronOptimizer


def trained(actor: Trainer) -> Iterator[tuple[str, Any, torch.Tensor, Any]]:
    """(name, model parameter, the tensor Adam updates, its torch optimizer) of each trained
    parameter; the tensor is the parameter, or under --bf16 megatron's float32 main copy."""
    inner = getattr(actor.optimizer, "chained_optimizers", [actor.optimizer])
    owner = {}
    for megatron_optimizer in inner:
        # Adam's zero moments where no step has run yet, as its first step makes them (its step
        # 0: `optimizer_state`), so that a checkpoint holds every trained parameter's state.
        megatron_optimizer.init_state_fn(megatron_optimizer.optimizer, megatron_optimizer.config)
        for group in megatron_optimizer.optimizer.param_groups:
            owner.update((id(p), megatron_optimizer.optimizer) for p in group["params"])
    for name, param in actor.gpt.named_parameters():
        main = getattr(param, "main_param", param)
        if id(main) in owner:
            yield name, param, main, owner[id(main)]


def optimizer_state(actor: Trainer, model: dict[str, Any]) -> dict[str, Any]:
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
    for name, param, main, optimizer in trained(actor):
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


def restore_optimizer(actor: Trainer, loaded: dict[str, Any]) -> None:
    """Copy `optimizer_state`'s loaded tensors and step into the optimizer. Its param groups
    stay this run's (learning rate, betas, weight decay: flags, with no schedule to resume)."""
    saved = loaded["state"]
    step = saved["common_step"]
    for name, _, main, optimizer in trained(actor):
        adam = optimizer.state[main]
        for key, tensor in saved[name].items():
            (main.data if key == "fp32_param" else adam[key]).copy_(tensor)
        if _steps_in_groups(optimizer):
            for group in optimizer.param_groups:
                group["step"] = int(step.item())
        else:
            adam["step"] = step.clone()


def _steps_in_groups(optimizer: torch.optim.Optimizer) -> bool:
    """Whether `optimizer` counts its steps per param group (`group["step"]`): Transformer
    Engine's and Apex's FusedAdam do, which megatron uses wherever either is installed (GPU
    runs); torch's Adam and AdamW (megatron's without them) count per parameter."""
    return not isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW)


def _step(optimizer: torch.optim.Optimizer, adam: dict[str, Any]) -> torch.Tensor:
    """The steps `optimizer` took, as torch's Adam keeps them (a float32 scalar on the CPU).
    Torch's: a parameter's state gets its step 0 where none ran yet (megatron's init_state_fn
    made its moments, and torch's Adam would not add a step to a state that is not empty)."""
    if _steps_in_groups(optimizer):
        steps = {int(g.get("step", 0)) for g in optimizer.param_groups if g["params"]} or {0}
        if len(steps) > 1:  # every group steps together (megatron asserts it too)
            raise RuntimeError(f"the optimizer's param groups took different steps: {steps}")
        return torch.tensor(float(steps.pop()), dtype=torch.float32, device="cpu")
    return adam.setdefault("step", torch.zeros((), dtype=torch.float32, device="cpu"))
