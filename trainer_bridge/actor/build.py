"""Building one trainer rank: its place in megatron's process groups, the policy (a GPTModel loaded
from --hf-checkpoint, or --ref-load where a run starts from it), megatron's DDP wrapper and Adam
around it, and the frozen reference model of the KL term.

megatron is imported inside the functions that need it, so importing the actor stays light (the
launcher's checks and the converter do not load megatron).
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from spec_engine.models.hf_config import ModelConfig
from trainer_bridge.drafts.mtp_training import set_trainable
from trainer_bridge.model import moe
from trainer_bridge.options import TrainerArgs
from trainer_bridge.parallel.expert import check_expert_parallel
from trainer_bridge.routing_replay import replay_config


def check_args(args: TrainerArgs) -> None:
    """Refuse what no rank can run: no --hf-checkpoint, or --bf16 without CUDA."""
    if args.hf_checkpoint is None:
        raise ValueError(
            "--hf-checkpoint is required: the Hugging Face checkpoint the policy starts from"
        )
    if args.bf16 and not torch.cuda.is_available():
        raise ValueError(
            "--bf16 needs CUDA (megatron's mixed-precision optimizer only wraps CUDA tensors); "
            "train in float32 on CPU"
        )


def params_dtype(args: TrainerArgs) -> torch.dtype:
    """The dtype of the policy's parameters: bfloat16 with --bf16, else float32."""
    return torch.bfloat16 if args.bf16 else torch.float32


def model_overrides(args: TrainerArgs, arch: ModelConfig) -> dict[str, Any]:
    """build_gpt_model's keywords for the policy and the reference model alike (both replay the
    rollout's routes, as slime's reference does): routing replay and the MoE balance loss in the
    TransformerConfig, the parameters' dtype and --qkv-format's packing. Refuses MoE flags the
    checkpoint cannot take, before any process group starts."""
    overrides = replay_config(args, arch)
    overrides.update(moe.balance_config(args, arch))
    overrides.update(params_dtype=params_dtype(args), packed=args.qkv_format == "thd")
    return overrides


def join_groups(
    args: TrainerArgs,
    arch: ModelConfig,
    rank: int,
    world_size: int,
    master_addr: str,
    master_port: Optional[int],
) -> tuple[int, int]:
    """Start this rank's megatron process groups (tensor, expert and data parallel) and return its
    (data-parallel size, data-parallel rank). Megatron's default rank order puts the ranks of a
    tensor-parallel group next to each other, so rank // tp is the data-parallel rank.

    Alone (no `master_port`) the rank picks a fresh port, since an inherited MASTER_PORT may
    belong to a group that is gone."""
    from trainer_bridge.megatron_compat import free_port, init_model_parallel

    ep, tp = args.expert_model_parallel_size, args.tensor_model_parallel_size
    check_expert_parallel(arch, ep, tp, world_size, args.expert_tp)
    init_model_parallel(
        tp,
        rank=rank,
        world_size=world_size,
        ep=ep,
        etp=args.expert_tp,
        seed=args.seed,
        master_addr=master_addr,
        master_port=master_port or free_port(),
    )
    dp_size, dp_rank = world_size // tp, rank // tp
    if args.global_batch_size is not None and args.global_batch_size % dp_size:
        raise ValueError(
            f"--global-batch-size {args.global_batch_size} does not split over {dp_size} "
            "data-parallel trainer ranks; make it a multiple"
        )
    return dp_size, dp_rank


def build_policy(
    args: TrainerArgs, arch: ModelConfig, overrides: dict[str, Any], device: torch.device
) -> Any:
    """The policy's GPTModel on `device`: --hf-checkpoint's weights, or --ref-load's where it is
    given (slime: a run with nothing to resume starts from it; a resumed run loads its own
    checkpoint over them later). Only the MTP layers that learn stay trainable, and megatron's
    balance-loss tracker is set up with --moe-aux-loss-coeff."""
    from trainer_bridge.checkpoint import load_reference
    from trainer_bridge.convert import load_hf_weights
    from trainer_bridge.model.provider import build_gpt_model

    model = build_gpt_model(args.hf_checkpoint, device=device, **overrides)
    load_hf_weights(model, args.hf_checkpoint)
    if args.ref_load is not None:
        load_reference(model, args.ref_load)
    if args.moe_aux_loss_coeff:
        moe.track_aux_losses(arch, device)
    set_trainable(model, arch.num_mtp_layers, args.enable_mtp_training)
    return model


def data_parallel_model(model: Any) -> Any:
    """megatron's DistributedDataParallel around the policy: it reduces the gradients over the
    data-parallel ranks (in float32) and keeps them in its buffers for the optimizer."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    return DistributedDataParallel(
        config=model.config,
        module=model,
        ddp_config=DistributedDataParallelConfig(grad_reduce_in_fp32=True),
    )


def adam(args: TrainerArgs, model: Any) -> Any:
    """megatron's Adam over the DDP-wrapped policy: a constant --lr (no schedule), --weight-decay,
    --adam-beta1/2 and --clip-grad; under --bf16 its float32 main copies of the weights."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    config = OptimizerConfig(
        optimizer="adam",
        lr=args.lr,
        min_lr=args.lr,
        weight_decay=args.weight_decay,
        adam_beta1=args.adam_beta1,
        adam_beta2=args.adam_beta2,
        clip_grad=args.clip_grad,
        bf16=args.bf16,
        params_dtype=params_dtype(args),
    )
    return get_megatron_optimizer(config, [model])


def build_reference(
    args: TrainerArgs, overrides: dict[str, Any], device: torch.device, policy: Any
) -> Any:
    """The KL term's frozen reference model: the weights the run starts from (--ref-load's, else
    --hf-checkpoint's), copied from the policy before a resumed run loads its own weights, so a
    resumed run keeps the reference it started with."""
    from trainer_bridge.convert import load_mcore_state_dict
    from trainer_bridge.model.provider import build_gpt_model

    ref = build_gpt_model(args.hf_checkpoint, device=device, **overrides)
    ref.eval().requires_grad_(False)
    load_mcore_state_dict(ref, policy.state_dict())
    return ref
