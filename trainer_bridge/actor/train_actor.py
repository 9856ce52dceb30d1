"""TrainActor: one trainer rank, the policy on megatron-core — log-probs, RL and supervised train
steps (with online MTP and draft training), Hugging Face export, the weights to push into the
engines, and training checkpoints.

Usable as a plain object (tests, one process) or wrapped with `ray.remote` by the launcher
(trainer_bridge.actor.group.TrainGroup). A batch is a `TrainBatch` of token sequences (prompt +
response) with per-response-token masks, rewards and the rollout's log-probs; log-probs are
log_softmax(logits / temperature), as the engine reports them.

The rank is assembled by job: built by build.py's functions, its forward passes and log-probs in
forward.py (PolicyForward), its train steps in train_step.py (TrainSteps, on PolicyForward);
weight export and checkpoints are here.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, Optional

from torch import Tensor

from spec_engine.distributed.parallel_state import TPGroup
from trainer_bridge.actor import build
from trainer_bridge.actor.train_step import TrainSteps
from trainer_bridge.drafts.mtp_training import DraftLearningRate
from trainer_bridge.drafts.online import OnlineDraft
from trainer_bridge.loss import LossConfig
from trainer_bridge.options import TrainerArgs, check_mtp_flags
from trainer_bridge.parallel.data import DataParallel
from trainer_bridge.parallel.expert import exports_with_rank0
from trainer_bridge.weight_sync import WeightPusher, WeightSyncConfig, share_colocated


class TrainActor(TrainSteps):
    """One trainer rank. Alone (rank 0 of 1) it picks its own port; as one of `world_size` ranks
    (trainer_bridge.actor.group.TrainGroup) every rank gets the same batch: tensor-parallel ranks
    split the model, data-parallel ranks take their share of the sequences."""

    def __init__(
        self,
        args: TrainerArgs,
        loss_cfg: Optional[LossConfig] = None,
        temperature: float = 1.0,
        rank: int = 0,
        world_size: int = 1,
        master_addr: str = "127.0.0.1",
        master_port: Optional[int] = None,
    ) -> None:
        from trainer_bridge.model.provider import read_model_config, trainer_device

        build.check_args(args)
        self.args, self.loss_cfg, self.temperature = args, loss_cfg or LossConfig(), temperature
        self.arch = read_model_config(args.hf_checkpoint)
        check_mtp_flags(args, self.arch.num_mtp_layers, self.arch.architecture)
        overrides = build.model_overrides(args, self.arch)
        self.rank, self.world_size = rank, world_size
        self.dp_size, self.dp_rank = build.join_groups(
            args, self.arch, rank, world_size, master_addr, master_port
        )
        self.device = trainer_device()
        self.dp = DataParallel(self.dp_size, self.dp_rank, self.device, args.balance_data)
        self.gpt = build.build_policy(args, self.arch, overrides, self.device)
        self.model = build.data_parallel_model(self.gpt)
        self.optimizer = build.adam(args, self.model)
        self.draft_lr = DraftLearningRate(self.gpt, args.lr, args.draft_lr)
        self.online_draft = OnlineDraft.build(args, self.gpt, self.arch, self.device, world_size)
        self.ref = None
        if self.loss_cfg.use_kl_loss or self.loss_cfg.kl_coef:
            self.ref = build.build_reference(args, overrides, self.device, self.gpt)
        self.step = 0
        self._pusher: Optional[WeightPusher] = None
        self._pusher_key: Any = None
        self._push_group: Optional[TPGroup] = None

    def ready(self) -> int:
        """This rank, once the model is built and loaded (for Ray callers waiting on start-up)."""
        return self.rank

    # ---------------------------------------------------------------- export

    def push_weights(
        self,
        engines: Sequence[Any],
        cfg: WeightSyncConfig,
        version: str,
        output_dir: Optional[str] = None,
        colocated: bool = False,
    ) -> dict[str, float]:
        """Push the policy (and MTP layers) into the engines as weight `version` (see
        weight_sync; `colocated`: the engines share this rank's device)."""
        # Colocated tensor pushes from several ranks: each rank shares its own copy, for the
        # engine rank on its device (weight_sync.ColocatedPlan, slime's way).
        trainer = None
        if colocated and cfg.weight_sync_mode == "tensor" and self.world_size > 1:
            trainer = self._trainer_group()
        if self.rank != 0:
            if trainer is None:
                self._join_gathers()
                return {}
            tensors = self.online_draft.with_draft(self.hf_named_tensors())
            try:
                share_colocated(tensors, cfg, trainer)
            finally:
                for _ in tensors:  # after a failure, in step with rank 0's gathers below
                    pass
            return {}
        engine_ids = tuple(getattr(e, "_actor_id", id(e)) for e in engines)
        key = (cfg, output_dir, colocated, engine_ids)
        if self._pusher is None or self._pusher_key != key:
            if self._pusher is not None:
                self._pusher.close()
            self._pusher = WeightPusher(engines, cfg, output_dir, colocated, trainer)
            self._pusher_key = key
        tensors = self.online_draft.with_draft(self.hf_named_tensors())
        try:
            return self._pusher.push(tensors, version)
        finally:
            # After a failure the other TP ranks are still gathering: finish with them.
            for _ in tensors:
                pass

    def _trainer_group(self) -> TPGroup:
        """A gloo group of every trainer rank (objects on the CPU whatever the device), made
        once, by every rank in the same call."""
        if self._push_group is None:
            import torch.distributed as dist

            self._push_group = TPGroup(
                self.rank, self.world_size, cpu_group=dist.new_group(backend="gloo")
            )
        return self._push_group

    def _join_gathers(self) -> None:
        """Rank 0 exports; the other ranks of its tensor-parallel and expert groups take part in
        each gather (other data-parallel replicas hold the same weights and need not)."""
        if exports_with_rank0(self.dp_rank, self.args):
            for _ in self.hf_named_tensors():
                pass

    def hf_named_tensors(self) -> Iterator[tuple[str, Tensor]]:
        """The policy (and its MTP layers) under Hugging Face names, one tensor at a time."""
        from trainer_bridge.convert import mcore_to_hf_tensors

        return mcore_to_hf_tensors(self.gpt, self.arch)

    def save_hf(self, path: str) -> None:
        """A normal Hugging Face directory (config and tokenizer files copied from
        --hf-checkpoint)."""
        from trainer_bridge.convert import save_hf_checkpoint

        if self.rank != 0:
            self._join_gathers()
            return
        save_hf_checkpoint(self.hf_named_tensors(), path, like=self.args.hf_checkpoint)

    # ---------------------------------------------------------------- checkpoints

    def save_checkpoint(self, directory: str, rollout_id: int) -> None:
        """This rank's shards of model, optimizer and RNG (megatron's dist_checkpointing)."""
        from trainer_bridge.checkpoint import save_checkpoint

        save_checkpoint(self, directory, rollout_id)

    def load_checkpoint(self, directory: str) -> int:
        """Restore what save_checkpoint wrote (the reference model stays --hf-checkpoint's);
        returns the checkpoint's rollout id."""
        from trainer_bridge.checkpoint import load_checkpoint

        return load_checkpoint(self, directory)
