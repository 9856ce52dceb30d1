"""The train–rollout mismatch: how far the trainer's log-probs of a rollout's tokens are from the
engine's that sampled them, and the truncated importance sampling (TIS) that corrects for it;
slime's definitions and metric names.

The engine sampled each response token from its distribution pi_rollout (its kernels, its
precision: an FP8 or bf16 engine); the trainer scores the same tokens with pi_train, its own
forward of the same weights. Per response token, r = log pi_train - log pi_rollout.

* TIS (`--use-tis`, slime's `vanilla_tis_function`): the policy-gradient terms weighted by exp(r)
  clamped to [`--tis-clip-low`, `--tis-clip`]. Metrics `tis` (exp(r)), `tis_abs` (|exp(r) - 1|),
  `tis_clipfrac` (the share of tokens whose exp(r) lies outside the clamp) and specrl's
  `tis_weight` (the clamped weight).
* `--get-mismatch-metrics`: the metrics of slime's
  `examples/train_infer_mismatch_helper/mis.py` (`add_ppl_metrics`), named as slime logs them,
  with the `mis_` prefix; see `mismatch_metrics`.

Each function returns per-token values `[batch, T]` (a sequence's value broadcast over its tokens,
as mis.py expands them), which the loss's reduction (`trainer_bridge.loss.aggregate`, over
`loss_mask`) averages: a metric is a token mean or a mean of sequence means as the loss is, then
averaged over micro batches, optimizer steps and data-parallel ranks as every `train/` metric.
"""

from __future__ import annotations

import torch
from torch import Tensor

# exp() of a larger log-ratio overflows float32 (slime's SAFETY_BOUND in mis.py).
SAFETY_BOUND = 20.0


def _ratio(log_ratio: Tensor) -> Tensor:
    return torch.exp(log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND))


def tis_weights(
    train_logp: Tensor, rollout_logp: Tensor, clip_low: float, clip: float
) -> tuple[Tensor, Tensor]:
    """(exp(train_logp - rollout_logp), the same clamped to [clip_low, clip]): TIS's raw and
    applied weights, per token."""
    raw = _ratio(train_logp - rollout_logp)
    return raw, raw.clamp(clip_low, clip)


def tis_metrics(raw: Tensor, weights: Tensor) -> dict[str, Tensor]:
    """Per-token TIS metrics from `tis_weights`' pair: `tis`, `tis_weight`, `tis_abs`,
    `tis_clipfrac`."""
    return {
        "tis": raw,
        "tis_weight": weights,
        "tis_abs": (raw - 1.0).abs(),
        "tis_clipfrac": (weights != raw).to(raw.dtype),
    }


def mismatch_metrics(
    train_logp: Tensor, rollout_logp: Tensor, loss_mask: Tensor
) -> dict[str, Tensor]:
    """slime's mismatch metrics (mis.py's `add_ppl_metrics`, logged with its `mis_` prefix), per
    token `[batch, T]`; a sequence's means are over its `loss_mask` tokens.

    With r = train_logp - rollout_logp per token:
    `mis_kl` = -r (estimates KL(pi_rollout || pi_train) on the engine's samples), `mis_k3_kl` =
    exp(r) - r - 1 (the same KL, Schulman's k3: never negative; r clamped to +-20 in the exp, as
    mis.py clamps it for the chi-squared values, so that a masked token's garbage never
    overflows into a NaN); per sequence,
    `mis_training_log_ppl` = -mean(train_logp) and `mis_training_ppl` its exp,
    `mis_rollout_log_ppl` and `mis_rollout_ppl` likewise, `mis_log_ppl_diff` = mean(-r) (the two
    log perplexities' difference), `mis_log_ppl_abs_diff` its absolute value, `mis_ppl_ratio`
    its exp (training over rollout perplexity), `mis_chi2_token` = mean(exp(r)^2) - 1 and
    `mis_chi2_seq` = exp(2 sum(r)) - 1 (the chi-squared divergence of the token and sequence
    importance weights).
    """
    mask = loss_mask.to(train_logp.dtype)
    count = mask.sum(-1, keepdim=True).clamp(min=1)

    def seq_mean(x: Tensor) -> Tensor:
        return ((x * mask).sum(-1, keepdim=True) / count).expand_as(x)

    log_ratio = train_logp - rollout_logp
    training_log_ppl = -seq_mean(train_logp)
    rollout_log_ppl = -seq_mean(rollout_logp)
    log_ppl_diff = training_log_ppl - rollout_log_ppl
    seq_log_ratio = (log_ratio * mask).sum(-1, keepdim=True).expand_as(log_ratio)
    return {
        "mis_training_log_ppl": training_log_ppl,
        "mis_training_ppl": torch.exp(training_log_ppl),
        "mis_rollout_log_ppl": rollout_log_ppl,
        "mis_rollout_ppl": torch.exp(rollout_log_ppl),
        "mis_kl": -log_ratio,
        "mis_k3_kl": _ratio(log_ratio) - log_ratio - 1.0,
        "mis_log_ppl_diff": log_ppl_diff,
        "mis_log_ppl_abs_diff": log_ppl_diff.abs(),
        "mis_ppl_ratio": torch.exp(log_ppl_diff),
        "mis_chi2_token": seq_mean(_ratio(log_ratio).square()) - 1.0,
        "mis_chi2_seq": torch.exp(2.0 * seq_log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND)) - 1.0,
    }
