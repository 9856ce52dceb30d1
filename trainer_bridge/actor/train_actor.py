"""TrainActor: the policy on megatron-core — log-probs, RL train steps (with online MTP training),
Hugging Face export and the weights to push into the engines.

Usable as a plain object (tests, one process) or wrapped with `ray.remote` by the launcher. A
batch is a `TrainBatch` of token sequences (prompt + response) with per-response-token masks,
rewards and the rollout's log-probs; log-probs are log_softmax(logits / temperature), as the
engine reports them.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator, Sequence
from typing import Any, Optional

import torch
from torch import Tensor

from trainer_bridge import loss as losses
from trainer_bridge.batch import TrainBatch, pad_batch
from trainer_bridge.drafts.mtp_loss import mtp_loss
from trainer_bridge.drafts.mtp_training import DraftLearningRate, set_trainable
from trainer_bridge.drafts.online import OnlineDraft
from trainer_bridge.loss import LossConfig
from trainer_bridge.micro_batches.layout import MicroBatch
from trainer_bridge.micro_batches.plan import plan_micro_batches
from trainer_bridge.model import moe
from trainer_bridge.options import TrainerArgs, check_mtp_flags
from trainer_bridge.parallel import expert as expert_parallel
from trainer_bridge.parallel.data import DataParallel
from trainer_bridge.parallel.sequence import allreduce_norm_grads, local_tokens
from trainer_bridge.routing_replay import replay_config, replayed, routes_for
from trainer_bridge.weight_sync import WeightPusher, WeightSyncConfig

logger = logging.getLogger(__name__)


class TrainActor:
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
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        from trainer_bridge.checkpoint import load_reference
        from trainer_bridge.convert import load_hf_weights, load_mcore_state_dict
        from trainer_bridge.megatron_compat import free_port, init_model_parallel
        from trainer_bridge.model.provider import build_gpt_model, read_model_config, trainer_device

        if args.hf_checkpoint is None:
            raise ValueError(
                "--hf-checkpoint is required: the Hugging Face checkpoint the policy starts from"
            )
        if args.bf16 and not torch.cuda.is_available():
            raise ValueError(
                "--bf16 needs CUDA (megatron's mixed-precision optimizer only wraps CUDA tensors); "
                "train in float32 on CPU"
            )
        self.args, self.loss_cfg, self.temperature = args, loss_cfg or LossConfig(), temperature
        self.arch = read_model_config(args.hf_checkpoint)
        check_mtp_flags(args, self.arch.num_mtp_layers, self.arch.architecture)
        # TransformerConfig overrides of the policy and the reference model alike
        overrides = replay_config(args, self.arch)
        overrides.update(moe.balance_config(args, self.arch))
        ep, tp = args.expert_model_parallel_size, args.tensor_model_parallel_size
        expert_parallel.check_expert_parallel(self.arch, ep, tp, world_size, args.expert_tp)
        # Alone: a fresh port, since an inherited MASTER_PORT may belong to a group that is gone.
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
        self.rank, self.world_size = rank, world_size
        # Megatron's default rank order: the ranks of a TP group are adjacent.
        self.dp_size, self.dp_rank = world_size // tp, rank // tp
        if args.global_batch_size is not None and args.global_batch_size % self.dp_size:
            raise ValueError(
                f"--global-batch-size {args.global_batch_size} does not split over {self.dp_size} "
                "data-parallel trainer ranks; make it a multiple"
            )
        dtype = torch.bfloat16 if args.bf16 else torch.float32
        self.device = trainer_device()
        self.dp = DataParallel(self.dp_size, self.dp_rank, self.device, args.balance_data)
        # The policy's and the reference model's build (both replay routes, as slime's reference)
        overrides.update(params_dtype=dtype, device=self.device, packed=args.qkv_format == "thd")
        model = build_gpt_model(args.hf_checkpoint, **overrides)
        load_hf_weights(model, args.hf_checkpoint)
        if args.ref_load is not None:  # slime: a run with nothing to resume starts from it
            load_reference(model, args.ref_load)
        if args.moe_aux_loss_coeff:
            moe.track_aux_losses(self.arch, self.device)
        set_trainable(model, self.arch.num_mtp_layers, args.enable_mtp_training)
        self.model = DistributedDataParallel(
            config=model.config,
            module=model,
            ddp_config=DistributedDataParallelConfig(grad_reduce_in_fp32=True),
        )
        self.optimizer = get_megatron_optimizer(
            OptimizerConfig(
                optimizer="adam",
                lr=args.lr,
                min_lr=args.lr,
                weight_decay=args.weight_decay,
                adam_beta1=args.adam_beta1,
                adam_beta2=args.adam_beta2,
                clip_grad=args.clip_grad,
                bf16=args.bf16,
                params_dtype=dtype,
            ),
            [self.model],
        )
        self.draft_lr = DraftLearningRate(model, args.lr, args.draft_lr)
        self.online_draft = OnlineDraft.build(args, model, self.arch, self.device, world_size)
        self.gpt = model
        self.ref = None
        if self.loss_cfg.use_kl_loss or self.loss_cfg.kl_coef:
            # The KL term's frozen reference: the weights the run starts from (--ref-load's, else
            # --hf-checkpoint's), before a resumed run loads its policy.
            self.ref = build_gpt_model(args.hf_checkpoint, **overrides)
            self.ref.eval().requires_grad_(False)
            load_mcore_state_dict(self.ref, model.state_dict())
        self.step = 0
        self._pusher: Optional[WeightPusher] = None
        self._pusher_key: Any = None

    def ready(self) -> int:
        """This rank, once the model is built and loaded (for Ray callers waiting on start-up)."""
        return self.rank

    # ---------------------------------------------------------------- forward

    @contextlib.contextmanager
    def _without_mtp(self, model: Any) -> Iterator[None]:
        """Megatron's GPTModel runs its MTP block (and needs labels) inside forward; the policy's
        logits do not depend on it, and the MTP loss is computed separately (with a detached
        trunk)."""
        saved = (model.mtp_process, model.config.mtp_num_layers)
        model.mtp_process, model.config.mtp_num_layers = False, None
        try:
            yield
        finally:
            model.mtp_process, model.config.mtp_num_layers = saved

    def _micro_batch(self, tokens: Tensor, lengths: list[int]) -> MicroBatch:
        """Padded `tokens` [b, S] (row i holding lengths[i] tokens) in --qkv-format's layout,
        its sequence a multiple of the TP size (which sequence parallelism splits it by), as
        long as the expert group's (a collective over it at EP > 1)."""
        return expert_parallel.aligned_micro_batch(tokens, lengths, self.args)

    def _forward(
        self, batch: MicroBatch, reference: bool = False, routes: Optional[Tensor] = None
    ) -> tuple[Tensor, Tensor]:
        """(logits over the real vocabulary [b, s, V], trunk hidden states [s, b, h]) of the
        policy, or of the frozen reference model, in `batch`'s layout (packed: b = 1, s = T);
        MoE layers route to `routes` [b, S, MoE layers, top_k] (padded layout) when given."""
        gpt, run = (self.ref, self.ref) if reference else (self.gpt, self.model)
        captured = []
        hook = gpt.decoder.register_forward_hook(lambda _m, _i, out: captured.append(out))
        try:
            routes = None if routes is None else local_tokens(gpt, batch.pack(routes))
            with self._without_mtp(gpt), replayed(gpt, routes):
                logits = run(
                    batch.tokens,
                    batch.position_ids,
                    None,
                    packed_seq_params=batch.packed_seq_params,
                    runtime_gather_output=True,
                    padding_mask=batch.padding_mask,
                )
        finally:
            hook.remove()
        return logits[..., : self.arch.vocab_size], captured[0]

    @torch.no_grad()
    def compute_log_probs(self, batch: TrainBatch, reference: bool = False) -> list[list[float]]:
        """Per response token: log_softmax(logits / temperature) of the sampled token (of the
        frozen reference model with `reference`)."""
        self.model.eval()
        out: list[list[float]] = [[] for _ in batch.tokens]
        lengths = [len(seq) for seq in batch.tokens]
        for rows in self._micro_batches(range(len(batch)), lengths, log_probs=True):
            part = batch.select(rows)
            tokens, _, _ = pad_batch(part, self.device)
            routes = routes_for(self.args, part, tokens.shape[1], self.arch, self.device)
            mb = self._micro_batch(tokens, [lengths[i] for i in rows])
            logits, _ = self._forward(mb, reference, routes)
            logp = mb.unpack(
                losses.token_log_probs(logits[:, :-1], mb.tokens[:, 1:], self.temperature), 1
            ).tolist()
            for row, values, n in zip(rows, logp, part.response_lengths):
                out[row] = values[lengths[row] - n - 1 : lengths[row] - 1]
        return out

    def _micro_batches(
        self, rows: Sequence[int], lengths: list[int], log_probs: bool = False
    ) -> list[list[int]]:
        """`rows` of a batch (row i holding lengths[i] tokens) in micro batches, as many on every
        data-parallel rank (trainer_bridge.micro_batches.plan)."""
        args = self.args
        budget = args.log_probs_max_tokens_per_gpu if log_probs else args.max_tokens_per_gpu
        return plan_micro_batches(
            rows,
            [lengths[i] for i in rows],
            args.micro_batch_size,
            budget if args.use_dynamic_batch_size else None,
            packed=args.qkv_format == "thd",
            align=self.dp.max,
        )

    # ---------------------------------------------------------------- train

    def train(self, batch: TrainBatch) -> dict[str, float]:
        """One rollout's RL update: old log-probs, advantages, then optimizer steps over
        global batches of micro batches. Returns slime's train/ metrics (means over steps)."""
        start = time.perf_counter()
        tokens, mask, rollout = pad_batch(batch, self.device)
        share, rows = self.dp.share(batch)
        # The KL-shaped advantages of --kl-coef need every sequence's log-probs, not this rank's
        # share.
        scored = batch if self.loss_cfg.kl_coef else share
        old_logp = self._logp_matrix(scored, mask.shape[1])
        ref_logp = (
            self._logp_matrix(scored, mask.shape[1], reference=True)
            if self.ref is not None
            else None
        )
        kl = None
        if self.loss_cfg.kl_coef:
            kl = losses.kl_penalty(old_logp, ref_logp, self.loss_cfg.kl_loss_type)
            old_logp, ref_logp = old_logp[rows], ref_logp[rows]
        # Advantages need whole groups: computed on the full batch, then this rank takes its rows.
        advantages = losses.compute_advantages(
            torch.tensor(batch.rewards, dtype=torch.float32, device=self.device),
            mask,
            self.loss_cfg,
            batch.n_samples_per_prompt,
            kl=kl,
        )
        routes = routes_for(self.args, batch, tokens.shape[1], self.arch, self.device)
        batch = share
        tokens, mask, rollout, advantages = (t[rows] for t in (tokens, mask, rollout, advantages))
        has_rollout = batch.rollout_log_probs is not None

        def rl_loss(
            sl: tuple[Tensor, slice], mb: MicroBatch, logits: Tensor, normalizer: Optional[Tensor]
        ) -> tuple[Tensor, dict[str, Tensor]]:
            logp, entropy = (
                mb.unpack(x, 1)
                for x in losses.log_probs_and_entropy(
                    logits[:, :-1], mb.tokens[:, 1:], self.temperature
                )
            )
            if not self.loss_cfg.entropy_coef:
                entropy = entropy.detach()  # logged as train/entropy only
            return losses.policy_loss(
                logp,
                old_logp[sl],
                advantages[sl],
                mask[sl],
                self.loss_cfg,
                ref_logp=None if ref_logp is None else ref_logp[sl],
                rollout_logp=rollout[sl] if has_rollout else None,
                entropy=entropy,
                normalizer=normalizer,
            )

        return self._train_steps(
            tokens,
            [len(seq) for seq in batch.tokens],
            mask,
            rl_loss,
            start,
            per_token=self.loss_cfg.loss_agg_mode == "token-mean",
            routes=None if routes is None else routes[rows],
        )

    def train_sft(self, batch: TrainBatch) -> dict[str, float]:
        """Supervised steps: mean cross-entropy of the response tokens (plus the MTP loss when
        MTP training is on) — the warm-up before RL."""
        start = time.perf_counter()
        batch, _ = self.dp.share(batch)
        tokens, mask, _ = pad_batch(batch, self.device)

        def sft_loss(
            sl: tuple[Tensor, slice], mb: MicroBatch, logits: Tensor, normalizer: Optional[Tensor]
        ) -> tuple[Tensor, dict[str, Tensor]]:
            logp = mb.unpack(losses.token_log_probs(logits[:, :-1], mb.tokens[:, 1:]), 1)
            loss = -(logp * mask[sl]).sum() / normalizer
            return loss, {"loss": loss.detach()}

        lengths = [len(seq) for seq in batch.tokens]
        return self._train_steps(tokens, lengths, mask, sft_loss, start, per_token=True)

    def _logp_matrix(self, batch: TrainBatch, width: int, reference: bool = False) -> Tensor:
        """compute_log_probs laid out like _pad's mask ([len(batch), width]; position t scores
        token t + 1)."""
        out = torch.zeros(len(batch), width, dtype=torch.float32, device="cpu")
        for i, (seq, n, lp) in enumerate(
            zip(batch.tokens, batch.response_lengths, self.compute_log_probs(batch, reference))
        ):
            out[i, len(seq) - n - 1 : len(seq) - 1] = torch.tensor(
                lp, dtype=torch.float32, device="cpu"
            )
        return out.to(self.device)

    def _train_steps(
        self,
        tokens: Tensor,
        lengths: list[int],
        mask: Tensor,
        loss_fn,
        start: float,
        per_token: bool,
        routes: Optional[Tensor] = None,
    ) -> dict[str, float]:
        """Optimizer steps over global batches; returns slime's train/ metrics (means over steps).

        `loss_fn(positions, micro batch, logits, normalizer)`, positions: the micro batch's rows
        (index tensor) and columns in the [b, S - 1] tensors. With `per_token` the loss is a sum
        over tokens / `normalizer` (the step's token count over all data-parallel ranks / dp
        size: DDP's averaging gives the global token mean); else a mean over the micro batch's
        sequences (normalizer None), weighted here by its share of the step."""
        step_size = (
            self.args.global_batch_size // self.dp_size
            if self.args.global_batch_size
            else tokens.shape[0]
        )
        totals: dict[str, list[float]] = {}
        self.model.train()
        for first in range(0, tokens.shape[0], step_size):
            rows = range(first, min(first + step_size, tokens.shape[0]))
            step = self._optimizer_step(
                tokens,
                lengths,
                mask,
                self._micro_batches(rows, lengths),
                loss_fn,
                per_token,
                routes,
            )
            for k, v in step.items():
                totals.setdefault(k, []).append(v)
        result = {f"train/{k}": sum(v) / len(v) for k, v in totals.items()}
        # train/entropy is the documented key (docs/design.md); slime names it entropy_loss.
        if "train/entropy_loss" in result:
            result["train/entropy"] = result["train/entropy_loss"]
        result["perf/actor_train_time"] = time.perf_counter() - start
        return result

    def _optimizer_step(
        self,
        tokens: Tensor,
        lengths: list[int],
        mask: Tensor,
        micro_batches: list[list[int]],
        loss_fn,
        per_token: bool,
        routes: Optional[Tensor],
    ) -> dict[str, float]:
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        n = sum(map(len, micro_batches))
        if self.args.moe_aux_loss_coeff:
            moe.scale_balance_loss(len(micro_batches), self.device)
        normalizer = None
        if per_token:
            count = mask[sum(micro_batches, [])].sum()  # the step's rows
            self.dp.all_reduce(count)
            normalizer = (count / self.dp_size).clamp(min=1.0 / self.dp_size)
        sums: dict[str, float] = {}
        for rows in micro_batches:
            index = torch.tensor(rows, dtype=torch.long, device=self.device)
            width = max(lengths[i] for i in rows)  # its own longest, as the budget counts
            mb_tokens, sl = tokens[index, :width], (index, slice(0, width - 1))  # sl: [b, S - 1]
            mb = self._micro_batch(mb_tokens, [lengths[i] for i in rows])
            logits, hidden = self._forward(
                mb, routes=None if routes is None else routes[index, :width]
            )
            loss, metrics = loss_fn(sl, mb, logits, normalizer)
            share = len(rows) / n  # micro batches add up to the step's mean
            self.online_draft.backward(mb_tokens, logits, mask[sl], share)
            weight = 1.0 if per_token else share  # per-token losses are partial sums already
            loss = loss * weight
            if self.args.enable_mtp_training:
                mtp = mtp_loss(self.gpt, self.arch.vocab_size, mb, hidden, mask[sl])
                loss = loss + self.args.mtp_loss_scaling_factor * mtp * share
                sums["mtp_loss"] = sums.get("mtp_loss", 0.0) + mtp.item() * share
            loss.backward()
            for k, v in metrics.items():
                sums[k] = sums.get(k, 0.0) + float(v) * weight
        self.model.finish_grad_sync()
        allreduce_norm_grads(self.model)  # replicated weights with per-TP-rank gradients
        if self.args.moe_aux_loss_coeff:  # megatron's tracker, summed over the micro batches
            moe_layers = moe.num_moe_layers(self.arch, self.args.enable_mtp_training)
            sums.update(moe.moe_aux_losses(moe_layers, num_micro_batches=len(micro_batches)))
        sums = self.dp.mean(sums)
        with self.draft_lr.step():
            ok, grad_norm, _ = self.optimizer.step()
        if not ok:
            raise RuntimeError(
                f"optimizer step {self.step} failed (grad norm {grad_norm}); lower --lr or check "
                "the batch"
            )
        self.step += 1
        moe.update_expert_bias(self.gpt, self.args.moe_router_bias_update_rate)
        sums.update(self.online_draft.step())
        sums["grad_norm"] = float(grad_norm) if grad_norm is not None else 0.0
        return sums

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
        if self.rank != 0:
            self._join_gathers()
            return {}
        engine_ids = tuple(getattr(e, "_actor_id", id(e)) for e in engines)
        key = (cfg, output_dir, colocated, engine_ids)
        if self._pusher is None or self._pusher_key != key:
            if self._pusher is not None:
                self._pusher.close()
            self._pusher = WeightPusher(engines, cfg, output_dir, colocated)
            self._pusher_key = key
        tensors = self.online_draft.with_draft(self.hf_named_tensors())
        try:
            return self._pusher.push(tensors, version)
        finally:
            # After a failure the other TP ranks are still gathering: finish with them.
            for _ in tensors:
                pass

    def _join_gathers(self) -> None:
        """Rank 0 exports; the other ranks of its tensor-parallel and expert groups take part in
        each gather (other data-parallel replicas hold the same weights and need not)."""
        if expert_parallel.exports_with_rank0(self.dp_rank, self.args):
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

    def warm_checkpoint_writer(self) -> None:
        """Start megatron's checkpoint writer in the background now (see
        trainer_bridge.checkpoint.warm_writer), so the first save does not wait for it."""
        from trainer_bridge.checkpoint import warm_writer

        warm_writer()
