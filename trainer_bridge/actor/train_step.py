"""The train steps of one trainer rank: a rollout's RL update (old and reference log-probs,
advantages, then the policy loss) and supervised steps (the warm-up before RL), each a series of
optimizer steps over global batches (--global-batch-size sequences, split over the data-parallel
ranks), each step a series of micro batches whose gradients add up.

A micro batch's loss joins the step's in one of two ways. A per-token loss (--loss-agg-mode
token-mean, and the supervised loss) is a sum over the micro batch's tokens divided by the step's
token count over all data-parallel ranks / dp size, so that DDP's averaging over the ranks leaves
the global token mean; any other loss is a mean over the micro batch's sequences, weighted here by
its share of the step's sequences. The MTP loss (--enable-mtp-training) and the draft trained
online (--enable-draft-training) learn in the same micro batches; after each step the MoE routers'
expert bias moves (--moe-router-bias-update-rate) and the online draft steps with its own Adam.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any, NamedTuple, Optional

import torch
from torch import Tensor

from trainer_bridge import loss as losses
from trainer_bridge.actor.forward import PolicyForward
from trainer_bridge.batch import TrainBatch, pad_batch
from trainer_bridge.drafts.mtp_loss import mtp_loss
from trainer_bridge.drafts.mtp_training import DraftLearningRate
from trainer_bridge.loss import LossConfig
from trainer_bridge.micro_batches.layout import MicroBatch
from trainer_bridge.model import moe
from trainer_bridge.parallel.sequence import allreduce_norm_grads
from trainer_bridge.routing_replay import routes_for

# (positions, micro batch, logits, normalizer) -> (loss, metrics); positions: the micro batch's
# rows (an index tensor) and columns in the step's [b, S - 1] tensors.
LossFn = Callable[
    [tuple[Tensor, slice], MicroBatch, Tensor, Optional[Tensor]],
    tuple[Tensor, dict[str, Tensor]],
]


@dataclass(frozen=True)
class StepInputs:
    """What every optimizer step of one train call reads: this rank's rows of the batch."""

    tokens: Tensor  # [b, S], right-padded
    lengths: list[int]  # tokens in each row
    mask: Tensor  # [b, S - 1]: the response positions to score (position t scores token t + 1)
    loss_fn: LossFn
    per_token: bool  # the loss is a sum over tokens / normalizer, else a mean over sequences
    routes: Optional[Tensor] = None  # [b, S, MoE layers, top_k]: the rollout's routes to replay


class RLTerms(NamedTuple):
    """The policy loss's inputs besides the policy's own log-probs: this rank's rows, [b, S - 1]
    each, the response positions of `mask` meaningful."""

    old_logp: Optional[Tensor]  # the trainer's before the update; None: not recomputed
    ref_logp: Optional[Tensor]  # the frozen reference model's, when a KL term needs them
    advantages: Tensor
    mask: Tensor
    rollout_logp: Optional[Tensor]  # the engine's, when the rollout reported them


class TrainSteps(PolicyForward):
    """TrainActor's train steps, on PolicyForward's forward passes. The attributes below are the
    rank's, set by TrainActor.__init__ (trainer_bridge.actor.train_actor)."""

    loss_cfg: LossConfig
    optimizer: Any  # megatron's MegatronOptimizer (Adam)
    draft_lr: DraftLearningRate
    online_draft: Any  # trainer_bridge.drafts.online.OnlineDraft, or its stand-in when off
    dp_size: int
    step: int  # optimizer steps taken

    def train(self, batch: TrainBatch) -> dict[str, float]:
        """One rollout's RL update: old log-probs (the trainer's, or with --use-rollout-logprobs
        the rollout's), advantages, then optimizer steps over global batches of micro batches.
        Returns slime's train/ metrics (means over steps)."""
        start = time.perf_counter()
        has_rollout = batch.rollout_log_probs is not None
        self.loss_cfg.check_rollout_log_probs(has_rollout)
        tokens, mask, rollout = pad_batch(batch, self.device)
        share, rows = self.dp.share(batch)
        old_logp, ref_logp, advantages = self._rl_terms(batch, share, rows, mask, rollout)
        routes = routes_for(self.args, batch, tokens.shape[1], self.arch, self.device)
        tokens, mask, rollout = (t[rows] for t in (tokens, mask, rollout))
        terms = RLTerms(old_logp, ref_logp, advantages, mask, rollout if has_rollout else None)
        inputs = StepInputs(
            tokens,
            [len(seq) for seq in share.tokens],
            mask,
            partial(self._rl_loss, terms),
            per_token=self.loss_cfg.loss_agg_mode == "token-mean",
            routes=None if routes is None else routes[rows],
        )
        return self._train_steps(inputs, start)

    def _rl_terms(
        self, batch: TrainBatch, share: TrainBatch, rows: Tensor, mask: Tensor, rollout: Tensor
    ) -> tuple[Optional[Tensor], Optional[Tensor], Tensor]:
        """(the trainer's old log-probs or None (--use-rollout-logprobs without
        --get-mismatch-metrics: not computed), reference log-probs or None, advantages) of this
        rank's `rows` of `batch` (`share`), [len(share), S - 1] each, before any step changes
        the policy; `rollout` holds the whole batch's rollout log-probs."""
        cfg = self.loss_cfg
        # The KL-shaped advantages of --kl-coef need every sequence's log-probs, not this rank's
        # share.
        scored = batch if cfg.kl_coef else share
        width = mask.shape[1]
        old_logp = self._logp_matrix(scored, width) if cfg.recomputes_log_probs else None
        ref_logp = (
            self._logp_matrix(scored, width, reference=True) if self.ref is not None else None
        )
        kl = None
        if cfg.kl_coef:
            # slime's: the old policy's log-probs are the rollout's under --use-rollout-logprobs.
            behaviour = rollout if cfg.use_rollout_logprobs else old_logp
            kl = losses.kl_penalty(behaviour, ref_logp, cfg.kl_loss_type)
            old_logp = None if old_logp is None else old_logp[rows]
            ref_logp = ref_logp[rows]
        # Advantages need whole groups: computed on the full batch, then this rank takes its rows.
        advantages = losses.compute_advantages(
            torch.tensor(batch.rewards, dtype=torch.float32, device=self.device),
            mask,
            cfg,
            batch.n_samples_per_prompt,
            kl=kl,
        )
        return old_logp, ref_logp, advantages[rows]

    def _rl_loss(
        self,
        terms: RLTerms,
        sl: tuple[Tensor, slice],
        mb: MicroBatch,
        logits: Tensor,
        normalizer: Optional[Tensor],
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """The policy loss (trainer_bridge.loss.policy_loss) of micro batch `mb` at positions `sl`
        of the step's tensors."""
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
            None if terms.old_logp is None else terms.old_logp[sl],
            terms.advantages[sl],
            terms.mask[sl],
            self.loss_cfg,
            ref_logp=None if terms.ref_logp is None else terms.ref_logp[sl],
            rollout_logp=None if terms.rollout_logp is None else terms.rollout_logp[sl],
            entropy=entropy,
            normalizer=normalizer,
        )

    def train_sft(self, batch: TrainBatch) -> dict[str, float]:
        """Supervised steps: mean cross-entropy of the response tokens (plus the MTP loss when
        MTP training is on) — the warm-up before RL."""
        start = time.perf_counter()
        batch, _ = self.dp.share(batch)
        tokens, mask, _ = pad_batch(batch, self.device)
        lengths = [len(seq) for seq in batch.tokens]
        sft_loss = partial(self._sft_loss, mask)
        return self._train_steps(StepInputs(tokens, lengths, mask, sft_loss, per_token=True), start)

    @staticmethod
    def _sft_loss(
        mask: Tensor,
        sl: tuple[Tensor, slice],
        mb: MicroBatch,
        logits: Tensor,
        normalizer: Optional[Tensor],
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """The response tokens' cross-entropy of micro batch `mb` at positions `sl`, a per-token
        sum / `normalizer`."""
        logp = mb.unpack(losses.token_log_probs(logits[:, :-1], mb.tokens[:, 1:]), 1)
        loss = -(logp * mask[sl]).sum() / normalizer
        return loss, {"loss": loss.detach()}

    def _train_steps(self, inputs: StepInputs, start: float) -> dict[str, float]:
        """Optimizer steps over global batches of `inputs`' rows (all of them in one step without
        --global-batch-size); returns slime's train/ metrics (means over steps) and the time
        since `start`."""
        rows_total = inputs.tokens.shape[0]
        step_size = (
            self.args.global_batch_size // self.dp_size
            if self.args.global_batch_size
            else rows_total
        )
        totals: dict[str, list[float]] = {}
        self.model.train()
        for first in range(0, rows_total, step_size):
            rows = range(first, min(first + step_size, rows_total))
            step = self._optimizer_step(inputs, self._micro_batches(rows, inputs.lengths))
            for k, v in step.items():
                totals.setdefault(k, []).append(v)
        result = {f"train/{k}": sum(v) / len(v) for k, v in totals.items()}
        # train/entropy is the documented key (docs/design.md); slime names it entropy_loss.
        if "train/entropy_loss" in result:
            result["train/entropy"] = result["train/entropy_loss"]
        result["perf/actor_train_time"] = time.perf_counter() - start
        return result

    def _optimizer_step(
        self, inputs: StepInputs, micro_batches: list[list[int]]
    ) -> dict[str, float]:
        """One optimizer step over `micro_batches` (rows of `inputs`): their gradients
        accumulated, then applied; returns the step's metrics."""
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        n = sum(map(len, micro_batches))
        if self.args.moe_aux_loss_coeff:
            moe.scale_balance_loss(len(micro_batches), self.device)
        normalizer = (
            self._token_normalizer(inputs.mask, micro_batches) if inputs.per_token else None
        )
        sums: dict[str, float] = {}
        for rows in micro_batches:
            for k, v in self._backward(inputs, rows, len(rows) / n, normalizer).items():
                sums[k] = sums.get(k, 0.0) + v
        return self._apply_step(sums, len(micro_batches))

    def _token_normalizer(self, mask: Tensor, micro_batches: list[list[int]]) -> Tensor:
        """The step's response-token count over all data-parallel ranks / dp size: a per-token
        loss divided by it gives, after DDP's averaging over the ranks, the global token mean."""
        count = mask[sum(micro_batches, [])].sum()  # the step's rows
        self.dp.all_reduce(count)
        return (count / self.dp_size).clamp(min=1.0 / self.dp_size)

    def _backward(
        self, inputs: StepInputs, rows: list[int], share: float, normalizer: Optional[Tensor]
    ) -> dict[str, float]:
        """Forward and backward of the micro batch of `rows` (`share` of the step's rows): its
        loss, the online draft's and the MTP layers'. Returns its metrics, weighted by its part
        of the step."""
        index = torch.tensor(rows, dtype=torch.long, device=self.device)
        width = max(inputs.lengths[i] for i in rows)  # its own longest, as the budget counts
        tokens, sl = inputs.tokens[index, :width], (index, slice(0, width - 1))  # sl: [b, S - 1]
        mb = self._micro_batch(tokens, [inputs.lengths[i] for i in rows])
        routes = None if inputs.routes is None else inputs.routes[index, :width]
        logits, hidden = self._forward(mb, routes=routes)
        loss, metrics = inputs.loss_fn(sl, mb, logits, normalizer)
        self.online_draft.backward(tokens, logits, inputs.mask[sl], share)
        weight = 1.0 if inputs.per_token else share  # per-token losses are partial sums already
        loss = loss * weight
        out: dict[str, float] = {}
        if self.args.enable_mtp_training:
            mtp = mtp_loss(self.gpt, self.arch.vocab_size, mb, hidden, inputs.mask[sl])
            loss = loss + self.args.mtp_loss_scaling_factor * mtp * share
            out["mtp_loss"] = mtp.item() * share
        loss.backward()
        out.update((k, float(v) * weight) for k, v in metrics.items())
        return out

    def _apply_step(self, sums: dict[str, float], num_micro_batches: int) -> dict[str, float]:
        """The accumulated gradients reduced (over data-parallel ranks, and the replicated norms'
        over tensor-parallel ones), Adam's step (the MTP layers' at --draft-lr), then the MoE
        routers' expert bias and the online draft's step. Returns the step's metrics `sums` (with
        the balance loss and the grad norm), averaged over the data-parallel ranks."""
        self.model.finish_grad_sync()
        allreduce_norm_grads(self.model)  # replicated weights with per-TP-rank gradients
        if self.args.moe_aux_loss_coeff:  # megatron's tracker, summed over the micro batches
            moe_layers = moe.num_moe_layers(self.arch, self.args.enable_mtp_training)
            sums.update(moe.moe_aux_losses(moe_layers, num_micro_batches=num_micro_batches))
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
