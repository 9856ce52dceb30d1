"""Policy losses for GRPO/GSPO training: advantages, PPO clipping, KL, entropy, TIS; pure torch.

Semantics and flag names follow slime (`--eps-clip`, `--kl-loss-type`, `--use-tis`, ...); the
train–rollout mismatch (TIS and its metrics) is `trainer_bridge.mismatch`.
Per-token tensors are padded `[batch, T]` with a per-token `loss_mask`; only `logp` (and
`entropy`) carry gradients, every other input is detached here.

GSPO uses the token-level form of the sequence ratio (verl's):
    log_ratio_t = seq_log_ratio.detach() + logp_t - logp_t.detach()
Every token's ratio equals the sequence ratio exp(mean_t(logp - old_logp)), and its gradient is
ratio * grad(logp_t). Summed over a sequence's tokens this is exactly the gradient of slime's form
(the sequence ratio broadcast to tokens and differentiated through the mean), but it stays
per-token, so masks and every aggregation mode apply unchanged.
"""

import argparse
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from spec_engine.args.dataclass_cli import add_dataclass_args, dataclass_from_args
from trainer_bridge import mismatch

ADVANTAGE_ESTIMATORS = ("grpo", "gspo", "reinforce_plus_plus_baseline")
KL_LOSS_TYPES = ("k1", "k2", "k3", "low_var_kl")
LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")
# exp() of a larger log-ratio overflows float32; inf * 0 (a zero advantage or a masked token)
# would then poison the loss with NaN. 20 is far outside any clip range, so values are unchanged.
MAX_LOG_RATIO = 20.0


def _upcast(x: Tensor) -> Tensor:
    """At least float32: bf16/fp16 log-probs lose the small differences these losses live on."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def _opt(default: Any, help: str, **meta: Any) -> Any:
    """A dataclass field carrying its CLI help (and optional `choices`, or `flag` for a
    --disable-x)."""
    return field(default=default, metadata={"help": help, **meta})


@dataclass
class LossConfig:
    """Policy-loss options; names and defaults are slime's."""

    advantage_estimator: str = _opt(
        "grpo",
        "How advantages are computed (gspo also switches the loss to sequence-level ratios).",
        choices=ADVANTAGE_ESTIMATORS,
    )
    rewards_normalization: bool = _opt(
        True,
        "Turn off subtracting the group mean from rewards (on by default for grpo, gspo, "
        "reinforce_plus_plus_baseline).",
        flag="--disable-rewards-normalization",
    )
    grpo_std_normalization: bool = _opt(
        True,
        "Turn off dividing group-centred rewards by the group std (grpo/gspo), as Dr.GRPO does.",
        flag="--disable-grpo-std-normalization",
    )
    normalize_advantages: bool = _opt(
        False, "Whiten token advantages over the batch (masked mean 0, std 1)."
    )
    eps_clip: float = _opt(0.2, "PPO clip range: ratios below 1 - eps_clip are clipped.")
    eps_clip_high: float | None = _opt(
        None,
        "PPO upper clip range (ratios above 1 + eps_clip_high are clipped).",
        unset="--eps-clip",
    )
    eps_clip_c: float | None = _opt(
        None,
        "Dual-clip PPO bound (> 1): caps the loss of negative-advantage tokens at -c * A.",
        unset="none: no dual clip",
    )
    kl_coef: float = _opt(
        0.0, "KL penalty folded into token advantages (reinforce_plus_plus_baseline only)."
    )
    use_kl_loss: bool = _opt(False, "Add kl_loss_coef * KL(policy || reference) to the loss.")
    kl_loss_coef: float = _opt(0.0, "Weight of the KL loss term.")
    kl_loss_type: str = _opt(
        "k1",
        "KL estimator over r = logp - ref_logp: k1 r, k2 r^2/2, k3 exp(-r) + r - 1, low_var_kl k3 "
        "clamped to [-10, 10].",
        choices=KL_LOSS_TYPES,
    )
    entropy_coef: float = _opt(0.0, "Entropy bonus weight: loss -= entropy_coef * entropy.")
    use_tis: bool = _opt(
        False,
        "Multiply the policy loss by truncated importance weights exp(old_logp - rollout_logp): "
        "the trainer's probability of each sampled token over the engine's, clamped to "
        "[--tis-clip-low, --tis-clip].",
    )
    tis_clip: float = _opt(2.0, "Upper cap C of the TIS weights.")
    tis_clip_low: float = _opt(0.0, "Lower cap of the TIS weights.")
    use_rollout_logprobs: bool = _opt(
        False,
        "Use the rollout's (the engine's) log-probs as the PPO ratio's old log-probs instead of "
        "recomputing them in the trainer (one forward fewer; slime's bypass mode). Not with "
        "--use-tis.",
    )
    get_mismatch_metrics: bool = _opt(
        False,
        "Log the trainer-vs-rollout log-prob mismatch per rollout (train/mis_kl, "
        "train/mis_k3_kl, train/mis_*_ppl, ..., as slime's mis.py names them); the loss is "
        "unchanged. With --use-rollout-logprobs the trainer still recomputes its log-probs for "
        "them (one more forward).",
    )
    calculate_per_token_loss: bool = _opt(
        False, "Average the loss over all tokens of the batch (same as --loss-agg-mode token-mean)."
    )
    loss_agg_mode: str = _opt(
        "seq-mean-token-mean", "How per-token losses become one number.", choices=LOSS_AGG_MODES
    )

    def __post_init__(self) -> None:
        _check_choice("advantage_estimator", self.advantage_estimator, ADVANTAGE_ESTIMATORS)
        _check_choice("kl_loss_type", self.kl_loss_type, KL_LOSS_TYPES)
        _check_choice("loss_agg_mode", self.loss_agg_mode, LOSS_AGG_MODES)
        if self.calculate_per_token_loss:
            if self.loss_agg_mode not in ("token-mean", "seq-mean-token-mean"):
                raise ValueError(
                    "--calculate-per-token-loss means --loss-agg-mode token-mean; got "
                    f"--loss-agg-mode {self.loss_agg_mode}"
                )
            self.loss_agg_mode = "token-mean"
        for name in ("eps_clip", "eps_clip_high", "tis_clip_low"):
            if (getattr(self, name) or 0.0) < 0:
                raise ValueError(
                    f"--{name.replace('_', '-')} must be >= 0, got {getattr(self, name)}"
                )
        if self.eps_clip_c is not None and self.eps_clip_c <= 1.0:
            raise ValueError(f"--eps-clip-c must be > 1 for dual-clip PPO, got {self.eps_clip_c}")
        if self.tis_clip < self.tis_clip_low:
            raise ValueError(
                f"--tis-clip ({self.tis_clip}) must be >= --tis-clip-low ({self.tis_clip_low})"
            )
        if self.use_rollout_logprobs and self.use_tis:
            raise ValueError(
                "--use-rollout-logprobs and --use-tis cannot be set at the same time (as in "
                "slime): with the rollout's log-probs as the old log-probs the PPO ratio already "
                "measures the policy against the engine; drop --use-tis, or drop "
                "--use-rollout-logprobs to weight the trainer's ratio by TIS"
            )
        if self.kl_coef != 0.0 and self.advantage_estimator != "reinforce_plus_plus_baseline":
            raise ValueError(
                f"--kl-coef {self.kl_coef} only shapes reinforce_plus_plus_baseline advantages; "
                f"for {self.advantage_estimator} use --use-kl-loss --kl-loss-coef"
            )

    @property
    def clip_high(self) -> float:
        return self.eps_clip if self.eps_clip_high is None else self.eps_clip_high

    @property
    def recomputes_log_probs(self) -> bool:
        """Whether the trainer computes its own old log-probs before the update (not with
        --use-rollout-logprobs, unless --get-mismatch-metrics compares them with the rollout's)."""
        return not self.use_rollout_logprobs or self.get_mismatch_metrics

    def check_rollout_log_probs(self, available: bool) -> None:
        """Refuse flags that need the rollout's log-probs when a batch has none."""
        needing = [
            f"--{name.replace('_', '-')}"
            for name in ("use_rollout_logprobs", "use_tis", "get_mismatch_metrics")
            if getattr(self, name)
        ]
        if needing and not available:
            raise ValueError(
                f"{' and '.join(needing)} need{'s' if len(needing) == 1 else ''} the rollout's "
                "log-probs, but samples of this "
                "rollout carry none (Sample.rollout_log_probs): the built-in rollout records the "
                "engine's; a custom generate function must set them (one per response token), "
                "or drop the flag"
            )


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """Add one flag per LossConfig field (`--eps-clip`, ...; booleans are switches)."""
    add_dataclass_args(parser, LossConfig, "policy loss (LossConfig)")


def from_args(namespace: argparse.Namespace) -> LossConfig:
    """Build a LossConfig from flags added by `add_cli_args` (fields absent from the namespace keep
    defaults)."""
    return dataclass_from_args(LossConfig, namespace)


# ---------------------------------------------------------------- log-probs and entropy


def token_log_probs(logits: Tensor, tokens: Tensor, temperature: float = 1.0) -> Tensor:
    """log_softmax(logits / temperature) at `tokens`, in at least float32; logits `[..., V]`,
    tokens `[...]`."""
    logits = _upcast(logits) / temperature
    picked = logits.gather(-1, tokens.long().unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


def entropy_from_logits(logits: Tensor, temperature: float = 1.0) -> Tensor:
    """Entropy of softmax(logits / temperature) over the last dim, in at least float32."""
    return _entropy(torch.log_softmax(_upcast(logits) / temperature, dim=-1))


def log_probs_and_entropy(
    logits: Tensor, tokens: Tensor, temperature: float = 1.0
) -> tuple[Tensor, Tensor]:
    """token_log_probs and entropy_from_logits from one log_softmax over the vocabulary."""
    logp = torch.log_softmax(_upcast(logits) / temperature, dim=-1)
    return logp.gather(-1, tokens.long().unsqueeze(-1)).squeeze(-1), _entropy(logp)


def _entropy(logp: Tensor) -> Tensor:
    # Banned tokens (-inf logits) would give 0 * -inf = NaN; at the dtype minimum their term is 0.
    logp = logp.clamp(min=torch.finfo(logp.dtype).min)
    return -(logp.exp() * logp).sum(-1)


# ---------------------------------------------------------------- advantages


def group_advantages(
    rewards: Tensor, n_samples_per_prompt: int, std_normalization: bool = True, eps: float = 1e-6
) -> Tensor:
    """(r - group mean) / (group std + eps) for rewards laid out group after group; std is
    unbiased."""
    if n_samples_per_prompt < 1 or rewards.numel() % n_samples_per_prompt:
        raise ValueError(
            f"{rewards.numel()} rewards do not split into groups of "
            f"n_samples_per_prompt={n_samples_per_prompt}"
        )
    groups = rewards.float().reshape(-1, n_samples_per_prompt)
    centred = groups - groups.mean(-1, keepdim=True)
    # A single-sample group has no spread (its unbiased std is NaN); its advantage is already 0.
    if std_normalization and n_samples_per_prompt > 1:
        centred = centred / (groups.std(-1, keepdim=True) + eps)
    return centred.reshape(-1)


def masked_whiten(values: Tensor, mask: Tensor, eps: float = 1e-8) -> Tensor:
    """Shift and scale `values` to mean 0 and std 1 over the unmasked entries."""
    mask = mask.bool()
    count = mask.sum().clamp(min=1)
    mean = torch.where(mask, values, 0.0).sum() / count
    var = torch.where(mask, (values - mean) ** 2, 0.0).sum() / count
    return torch.where(mask, (values - mean) * torch.rsqrt(var + eps), 0.0)


def compute_advantages(
    rewards: Tensor,
    loss_mask: Tensor,
    cfg: LossConfig,
    n_samples_per_prompt: int,
    kl: Tensor | None = None,
) -> Tensor:
    """Per-token advantages `[batch, T]` from per-sample rewards `[batch]` (zero on masked tokens).

    `kl` (per token, e.g. `kl_penalty(old_logp, ref_logp, cfg.kl_loss_type)`) is needed when
    `cfg.kl_coef` is set.
    """
    scores = rewards.float()
    if cfg.rewards_normalization:
        use_std = cfg.grpo_std_normalization and cfg.advantage_estimator in ("grpo", "gspo")
        scores = group_advantages(scores, n_samples_per_prompt, use_std)
    advantages = scores.unsqueeze(-1).expand(loss_mask.shape)
    if cfg.kl_coef != 0.0:
        if kl is None:
            raise ValueError(f"kl_coef={cfg.kl_coef} needs the per-token kl tensor")
        advantages = advantages - cfg.kl_coef * kl.detach()
    if cfg.normalize_advantages:
        return masked_whiten(advantages, loss_mask)
    return torch.where(loss_mask.bool(), advantages, 0.0)


# ---------------------------------------------------------------- loss terms


def kl_penalty(logp: Tensor, ref_logp: Tensor, kl_type: str) -> Tensor:
    """Per-token estimate of KL(policy || reference) from sampled-token log-probs (Schulman's
    k1/k2/k3)."""
    log_ratio = _upcast(logp) - _upcast(ref_logp)
    if kl_type == "k1":
        return log_ratio
    if kl_type == "k2":
        return log_ratio**2 / 2
    if kl_type in ("k3", "low_var_kl"):
        kl = torch.expm1(-log_ratio) + log_ratio
        return kl.clamp(-10.0, 10.0) if kl_type == "low_var_kl" else kl
    raise ValueError(f"unknown kl_loss_type {kl_type!r}; valid: {', '.join(KL_LOSS_TYPES)}")


def ppo_clip_loss(
    log_ratio: Tensor,
    advantages: Tensor,
    eps_clip: float,
    eps_clip_high: float | None = None,
    eps_clip_c: float | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Per-token clipped surrogate loss, where the clip was active, and where the dual clip was
    active."""
    high = eps_clip if eps_clip_high is None else eps_clip_high
    ratio = torch.exp(log_ratio.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO))
    loss1 = -advantages * ratio
    loss2 = -advantages * ratio.clamp(1.0 - eps_clip, 1.0 + high)
    losses = torch.maximum(loss1, loss2)
    clipped = (loss2 > loss1).to(losses.dtype)
    if eps_clip_c is None:
        return losses, clipped, torch.zeros_like(clipped)
    loss3 = -advantages * eps_clip_c
    dual = (advantages < 0) & (losses > loss3)
    return torch.where(dual, loss3, losses), clipped, dual.to(losses.dtype)


def aggregate(
    values: Tensor, loss_mask: Tensor, mode: str, normalizer: float | Tensor | None = None
) -> Tensor:
    """Reduce per-token `values` `[batch, T]` to a scalar.

    token-mean: sum over unmasked tokens / their count; seq-mean-token-mean: mean over each
    sample's tokens, then mean over samples; seq-mean-token-sum: sum per sample, mean over
    samples. `normalizer` replaces the denominator (token count or sample count), so
    micro-batches reduced with the global count add up to the global mean.
    """
    mask = loss_mask.bool()
    masked = torch.where(mask, values, 0.0)
    if mode == "token-mean":
        return masked.sum() / (mask.sum().clamp(min=1) if normalizer is None else normalizer)
    if mode not in LOSS_AGG_MODES:
        raise ValueError(f"unknown loss_agg_mode {mode!r}; valid: {', '.join(LOSS_AGG_MODES)}")
    per_sample = masked.sum(-1)
    if mode == "seq-mean-token-mean":
        per_sample = per_sample / mask.sum(-1).clamp(min=1)
    # Fully masked samples still count as samples, as in slime's sum of sample means.
    return per_sample.sum() / (per_sample.numel() if normalizer is None else normalizer)


def gspo_log_ratio(logp: Tensor, old_logp: Tensor, loss_mask: Tensor) -> Tensor:
    """Token-level log of the GSPO sequence ratio (value: sequence mean; gradient: each token's
    logp)."""
    mask = loss_mask.bool()
    seq = torch.where(mask, logp - old_logp, 0.0).sum(-1) / mask.sum(-1).clamp(min=1)
    return seq.detach().unsqueeze(-1) + logp - logp.detach()


def policy_loss(
    logp: Tensor,
    old_logp: Tensor | None,
    advantages: Tensor,
    loss_mask: Tensor,
    cfg: LossConfig,
    *,
    ref_logp: Tensor | None = None,
    rollout_logp: Tensor | None = None,
    entropy: Tensor | None = None,
    normalizer: float | Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Scalar loss and detached metrics for one batch of `[batch, T]` per-token tensors.

    `old_logp` are the trainer's log-probs before the update, the PPO ratio's reference; with
    `use_rollout_logprobs` the reference is `rollout_logp` (the engine's) instead, and `old_logp`
    (None when not recomputed) serves only the mismatch metrics. KL metrics need `ref_logp`
    (added to the loss only with `use_kl_loss`); TIS and mismatch metrics need `rollout_logp`
    (`_rollout_correction`). Metrics use the loss's reduction.
    """
    train_logp = None if old_logp is None else old_logp.detach()
    if cfg.use_rollout_logprobs:
        if rollout_logp is None:
            raise ValueError("--use-rollout-logprobs needs rollout_logp")
        old_logp = rollout_logp.detach()
    elif train_logp is None:
        raise ValueError("old_logp is needed unless --use-rollout-logprobs")
    else:
        old_logp = train_logp
    advantages = advantages.detach()
    if cfg.advantage_estimator == "gspo":
        log_ratio = gspo_log_ratio(logp, old_logp, loss_mask)
    else:
        log_ratio = logp - old_logp
    pg, clipped, dual = ppo_clip_loss(
        log_ratio, advantages, cfg.eps_clip, cfg.clip_high, cfg.eps_clip_c
    )

    def reduce(values: Tensor) -> Tensor:
        return aggregate(values, loss_mask, cfg.loss_agg_mode, normalizer)

    metrics: dict[str, Tensor] = {}
    pg = _rollout_correction(
        pg, logp, log_ratio, train_logp, rollout_logp, loss_mask, cfg, reduce, metrics
    )
    loss = metrics["pg_loss"] = reduce(pg)
    metrics.update(pg_clipfrac=reduce(clipped), ppo_kl=reduce(-log_ratio))
    if cfg.eps_clip_c is not None:
        metrics["pg_clipfrac_lower"] = reduce(dual)
    loss = _with_regularizers(loss, logp, ref_logp, entropy, cfg, reduce, metrics)
    metrics["loss"] = loss
    return loss, {k: v.detach() for k, v in metrics.items()}


def _rollout_correction(
    pg: Tensor,
    logp: Tensor,
    log_ratio: Tensor,
    train_logp: Tensor | None,
    rollout_logp: Tensor | None,
    loss_mask: Tensor,
    cfg: LossConfig,
    reduce: Callable[[Tensor], Tensor],
    metrics: dict[str, Tensor],
) -> Tensor:
    """The per-token policy-gradient terms `pg`, weighted by TIS with --use-tis
    (`trainer_bridge.mismatch`: the rollout's tokens were sampled from the engine's
    distribution, not the trainer's), and the mismatch metrics added to `metrics`, as slime's
    policy_loss_function has them: with the rollout's log-probs, `train_rollout_logprob_abs_diff`
    (|trainer - rollout|: the trainer's old log-probs, or the current ones under
    --use-rollout-logprobs) and, when the trainer's old log-probs are there too, TIS's metrics
    (applied or not); `ois` (the PPO ratio) with --use-tis or --get-mismatch-metrics; slime's
    `mis_*` metrics with --get-mismatch-metrics."""
    if rollout_logp is None:
        if cfg.use_tis or cfg.get_mismatch_metrics:
            raise ValueError("--use-tis and --get-mismatch-metrics need rollout_logp")
        return pg
    rollout_logp = rollout_logp.detach()
    compared = logp.detach() if cfg.use_rollout_logprobs else train_logp
    metrics["train_rollout_logprob_abs_diff"] = reduce((compared - rollout_logp).abs())
    if cfg.use_tis or cfg.get_mismatch_metrics:
        metrics["ois"] = reduce(torch.exp(log_ratio.detach().clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)))
    if train_logp is None:
        if cfg.get_mismatch_metrics:
            raise ValueError("--get-mismatch-metrics needs the trainer's old_logp")
        return pg
    raw, weights = mismatch.tis_weights(train_logp, rollout_logp, cfg.tis_clip_low, cfg.tis_clip)
    metrics.update((k, reduce(v)) for k, v in mismatch.tis_metrics(raw, weights).items())
    if cfg.get_mismatch_metrics:
        per_token = mismatch.mismatch_metrics(train_logp, rollout_logp, loss_mask)
        metrics.update((k, reduce(v)) for k, v in per_token.items())
    return pg * weights if cfg.use_tis else pg


def _with_regularizers(
    loss: Tensor,
    logp: Tensor,
    ref_logp: Tensor | None,
    entropy: Tensor | None,
    cfg: LossConfig,
    reduce: Callable[[Tensor], Tensor],
    metrics: dict[str, Tensor],
) -> Tensor:
    """`loss` minus the entropy bonus (--entropy-coef) and plus the KL loss to the reference
    model (--use-kl-loss, --kl-loss-coef). Their metrics (entropy_loss, kl) are added to
    `metrics` whenever `entropy` / `ref_logp` are given, the terms to the loss only when asked."""
    if entropy is not None:
        metrics["entropy_loss"] = reduce(entropy)
        loss = loss - cfg.entropy_coef * metrics["entropy_loss"]
    elif cfg.entropy_coef != 0.0:
        raise ValueError(f"entropy_coef={cfg.entropy_coef} needs the per-token entropy")
    if ref_logp is not None:
        metrics["kl"] = reduce(kl_penalty(logp, ref_logp.detach(), cfg.kl_loss_type))
        if cfg.use_kl_loss:
            loss = loss + cfg.kl_loss_coef * metrics["kl"]
    elif cfg.use_kl_loss:
        raise ValueError("use_kl_loss needs ref_logp")
    return loss


def _check_choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(
            f"--{name.replace('_', '-')} must be one of {', '.join(choices)}; got {value!r}"
        )
