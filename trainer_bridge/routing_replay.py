"""Routing replay (slime's R3, --use-rollout-routing-replay): megatron's MoE routers take the
experts the engine chose for each token instead of their own top-k, so the trainer's forward is
the rollout's (arxiv 2510.11370).

The engine reports SGLang's `meta_info.routed_experts`: int32 rows `[prompt + output - 1,
num_hidden_layers, top_k]` (dense layers 0), one per forwarded token. Megatron's routers
(TransformerConfig.moe_enable_routing_replay) read `[seq * batch, top_k]` indices, token
(position t, row b) at t * batch + b, as `routing()` flattens its `[s, b, experts]` logits.
Under sequence parallelism (MoE models at TP > 1) each tensor-parallel rank routes its own
contiguous part of the sequence, so the TrainActor hands each rank its part of the routes
(parallel.sequence.local_tokens) before they reach `replayed`. Only forwards route: without
activation recompute the backward reuses the forward's choice (megatron's REPLAY_BACKWARD serves
recompute, which the trainer does not turn on).
"""

from __future__ import annotations

import base64
import contextlib
import functools
from collections.abc import Iterator
from typing import Any, Optional

import numpy as np
import torch
from torch import Tensor

from spec_engine.models.hf_config import ModelConfig
from trainer_bridge.batch import TrainBatch
from trainer_bridge.options import TrainerArgs


def replay_config(args: TrainerArgs, arch: ModelConfig) -> dict[str, Any]:
    """TransformerConfig overrides of a model replaying the rollout's routing ({} without
    --use-rollout-routing-replay)."""
    if not args.use_rollout_routing_replay:
        return {}
    check_routing_replay(arch, str(args.hf_checkpoint))
    return {"moe_enable_routing_replay": True}


def check_routing_replay(arch: ModelConfig, checkpoint: str) -> None:
    """--use-rollout-routing-replay needs MoE layers to replay."""
    if arch.moe is None:
        raise ValueError(
            f"--use-rollout-routing-replay replays the rollout's MoE routing, and {checkpoint} "
            f"({arch.architecture}) is a dense model with no router; drop the flag"
        )


@functools.lru_cache(maxsize=4)
def routing_shape(checkpoint: str) -> tuple[int, int]:
    """(num_hidden_layers, top_k) of the rows the engine serving `checkpoint` reports."""
    arch = ModelConfig.load(checkpoint)
    check_routing_replay(arch, checkpoint)
    return arch.num_hidden_layers, arch.moe.top_k


def decode_routed_experts(meta: dict[str, Any], checkpoint: str) -> Tensor:
    """slime's decode of meta_info.routed_experts: int32 [tokens - 1, num_hidden_layers, top_k]
    (a tensor, which torch.load(weights_only=True) of saved rollouts accepts)."""
    num_layers, top_k = routing_shape(checkpoint)
    if "routed_experts" not in meta:
        raise ValueError(
            f"request {meta.get('id')}: the engine returned no routed_experts; start it with "
            "--sglang-enable-return-routed-experts (--use-rollout-routing-replay sets it) and "
            "send return_routed_experts=True"
        )
    raw = np.frombuffer(base64.b64decode(meta["routed_experts"]), dtype=np.int32)
    return torch.from_numpy(raw.reshape(-1, num_layers, top_k).copy())


def moe_routers(model: Any) -> list[Any]:
    """The RouterReplay of each MoE layer of `model`'s decoder, in layer order (the MTP block's
    routers are left to route by themselves: the engine reports only the trunk's)."""
    return [
        m.router_replay
        for m in model.decoder.modules()
        if getattr(m, "router_replay", None) is not None
    ]


def routes_for(
    args: TrainerArgs, batch: TrainBatch, width: int, arch: ModelConfig, device: torch.device
) -> Optional[Tensor]:
    """[b, width, MoE layers, top_k] int64: the engine's expert ids of each token of `batch`, in
    megatron's router order (None without --use-rollout-routing-replay). Positions the engine
    did not forward (the last token, right padding) repeat the last reported row: any valid
    experts do, since nothing scored depends on them (causal attention, masked loss)."""
    if not args.use_rollout_routing_replay:
        return None
    if batch.rollout_routed_experts is None:
        raise ValueError(
            "--use-rollout-routing-replay: the batch has no rollout_routed_experts; generate it "
            "with return_routed_experts=True (rollout.generate does with the flag) and keep it "
            "on every Sample"
        )
    moe_layers = [i for i in range(arch.num_hidden_layers) if arch.moe.is_moe_layer(i)]
    out = []
    for i, (routes, seq) in enumerate(zip(batch.rollout_routed_experts, batch.tokens)):
        if routes.shape[0] != len(seq) - 1:
            raise ValueError(
                f"sequence {i}: {routes.shape[0]} rows of routed experts for {len(seq)} tokens; "
                "the engine reports one per forwarded token (tokens - 1, with "
                "routed_experts_start_len 0)"
            )
        rows = routes[:, moe_layers].to("cpu", torch.long)
        out.append(torch.cat([rows, rows[-1:].expand(width - rows.shape[0], -1, -1)]))
    return torch.stack(out).to(device)


@contextlib.contextmanager
def replayed(model: Any, routes: Optional[Tensor]) -> Iterator[None]:
    """Within it, `model`'s MoE routers take `routes` [b, s, MoE layers, top_k] (routes_for)
    instead of their own top-k; with `routes` None they route by themselves."""
    if routes is None:
        yield
        return
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    routers = moe_routers(model)
    if routes.shape[2] != len(routers):
        raise ValueError(
            f"routes for {routes.shape[2]} MoE layers, and the model has {len(routers)} routers"
        )
    # [b, s, L, k] -> per layer [s * b, k]: megatron's token order
    per_layer = routes.permute(2, 1, 0, 3).reshape(len(routers), -1, routes.shape[-1])
    for router, ids in zip(routers, per_layer):
        router.set_target_indices(ids)
        router.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
    try:
        yield
    finally:
        for router in routers:
            router.clear_router_replay_action()
            router.clear_indices()  # the indices would otherwise pile up in replay_backward_list
