"""The train–rollout mismatch (trainer_bridge.mismatch, through trainer_bridge.loss.policy_loss)
against slime's definitions re-written here in numpy on ragged per-sequence arrays, as slime holds
them: mis.py's add_ppl_metrics, vanilla_tis_function, train_rollout_logprob_abs_diff, and
get_sum_of_sample_mean's reduction; --use-rollout-logprobs as the PPO ratio's reference."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from trainer_bridge.loss import LossConfig, policy_loss

F64 = torch.float64

# A hand-built batch of three responses (2, 4 and 3 tokens, padded to 5). The rollout's log-probs
# are the trainer's minus a known d per token, so r = train - rollout = d and the TIS ratio is
# exp(d). Sequence 2's middle token is masked (a tool's output): its d = 5 must count nowhere.
TRAIN = [[-0.5, -1.2], [-2.0, -0.1, -0.7, -1.5], [-0.3, -4.0, -0.9]]
D = [[0.1, -0.2], [1.0, 0.0, -1.0, 0.3], [0.5, 5.0, -0.4]]
MASK = [[1, 1], [1, 1, 1, 1], [1, 0, 1]]
PAD = 5


def padded(rows, fill):
    return torch.tensor([r + [fill] * (PAD - len(r)) for r in rows], dtype=F64)


def batch():
    train = [np.array(t) for t in TRAIN]
    rollout = [t - np.array(d) for t, d in zip(train, D)]
    mask = [np.array(m, dtype=float) for m in MASK]
    # Padding holds garbage a missing mask would let in.
    tensors = padded(TRAIN, -9.0), padded([list(r) for r in rollout], 3.0), padded(MASK, 0.0)
    return (train, rollout, mask), tensors


def sum_of_sample_mean(values, mask, per_token):
    """slime's reduction (cp_utils.get_sum_of_sample_mean, over the global batch)."""
    if per_token:
        return sum((v * m).sum() for v, m in zip(values, mask)) / sum(m.sum() for m in mask)
    return sum((v * m).sum() / max(m.sum(), 1) for v, m in zip(values, mask)) / len(values)


def slime_metrics(train, rollout, mask, clip_low, clip):
    """Per-sequence per-token values of slime's metrics (mis.py's add_ppl_metrics with its mis_
    prefix; vanilla_tis_function's tis, tis_abs, tis_clipfrac; train_rollout_logprob_abs_diff)."""
    out: dict[str, list[np.ndarray]] = {}

    def add(key, value, like):
        out.setdefault(key, []).append(np.broadcast_to(value, like.shape).astype(float))

    for t, r, m in zip(train, rollout, mask):
        mean_t = (t * m).sum() / max(m.sum(), 1)
        mean_r = (r * m).sum() / max(m.sum(), 1)
        log_ratio = t - r
        add("mis_training_log_ppl", -mean_t, t)
        add("mis_training_ppl", np.exp(-mean_t), t)
        add("mis_rollout_log_ppl", -mean_r, t)
        add("mis_rollout_ppl", np.exp(-mean_r), t)
        add("mis_kl", r - t, t)
        add("mis_k3_kl", np.exp(log_ratio) - log_ratio - 1, t)
        add("mis_log_ppl_diff", mean_r - mean_t, t)
        add("mis_log_ppl_abs_diff", abs(mean_r - mean_t), t)
        add("mis_ppl_ratio", np.exp(mean_r - mean_t), t)
        rho = np.exp(np.clip(log_ratio, -20, 20))
        add("mis_chi2_token", (rho**2 * m).sum() / max(m.sum(), 1) - 1, t)
        add("mis_chi2_seq", np.exp(2 * np.clip((log_ratio * m).sum(), -20, 20)) - 1, t)
        tis = np.exp(t - r)
        weights = np.clip(tis, clip_low, clip)
        add("tis", tis, t)
        add("tis_abs", np.abs(tis - 1), t)
        add("tis_weight", weights, t)
        add("tis_clipfrac", (weights != tis).astype(float), t)
        add("train_rollout_logprob_abs_diff", np.abs(t - r), t)
    return out


@pytest.mark.parametrize("per_token", [False, True])
@pytest.mark.parametrize("clip_low", [0.0, 0.5])
def test_mismatch_metrics_equal_slimes_definitions(per_token, clip_low):
    (train, rollout, mask), (train_t, rollout_t, mask_t) = batch()
    cfg = LossConfig(
        get_mismatch_metrics=True, tis_clip_low=clip_low, calculate_per_token_loss=per_token
    )
    logp = train_t.clone().requires_grad_(True)
    adv = torch.ones_like(logp)
    _, got = policy_loss(logp, train_t, adv, mask_t, cfg, rollout_logp=rollout_t)
    want = {
        k: sum_of_sample_mean(v, mask, per_token)
        for k, v in slime_metrics(train, rollout, mask, clip_low, 2.0).items()
    }
    missing = set(want) - set(got)
    assert not missing, missing
    for key, value in want.items():
        assert got[key].item() == pytest.approx(value, rel=1e-12, abs=1e-12), key
    # The known amounts: |d| and the share of tokens whose exp(d) leaves [clip_low, 2].
    if per_token:
        assert got["train_rollout_logprob_abs_diff"].item() == pytest.approx(3.5 / 8, abs=1e-12)
        # exp(1) > 2 always; exp(-1) < 0.5 only with the lower cap.
        assert got["tis_clipfrac"].item() == pytest.approx((2 if clip_low else 1) / 8, abs=1e-12)
    else:
        assert got["tis_clipfrac"].item() == pytest.approx((2 if clip_low else 1) / 12, abs=1e-12)
        assert got["mis_kl"].item() == pytest.approx(-(-0.1 / 2 + 0.3 / 4 + 0.1 / 2) / 3, abs=1e-12)
    # ois is the PPO ratio's mean: on-policy here (logp == old log-probs), so 1.
    assert got["ois"].item() == pytest.approx(1.0, abs=1e-12)


def test_mismatch_metrics_leave_the_loss_unchanged_and_need_the_rollouts_log_probs():
    _, (train_t, rollout_t, mask_t) = batch()
    adv = torch.tensor([[1.0], [-1.0], [0.5]], dtype=F64).expand(3, PAD)
    logp = train_t + 0.05
    plain, m_plain = policy_loss(logp, train_t, adv, mask_t, LossConfig(), rollout_logp=rollout_t)
    measured, m = policy_loss(
        logp, train_t, adv, mask_t, LossConfig(get_mismatch_metrics=True), rollout_logp=rollout_t
    )
    assert measured.item() == plain.item()
    assert "mis_kl" in m and "mis_kl" not in m_plain and "ois" not in m_plain
    # Always there with the rollout's log-probs, as in slime.
    assert "train_rollout_logprob_abs_diff" in m_plain and "tis_clipfrac" in m_plain
    assert m["ois"].item() == pytest.approx(math.exp(0.05), abs=1e-12)
    with pytest.raises(ValueError, match="--get-mismatch-metrics need rollout_logp"):
        policy_loss(logp, train_t, adv, mask_t, LossConfig(get_mismatch_metrics=True))


def test_use_rollout_logprobs_makes_the_rollouts_log_probs_the_ratios_reference():
    """slime's bypass mode: old_log_probs = rollout_log_probs. The trainer's old log-probs no
    longer matter to the loss, the ratio is pi / pi_rollout."""
    logp = torch.zeros(1, 3, dtype=F64, requires_grad=True)
    trainer = torch.full((1, 3), 0.25, dtype=F64)  # the trainer's old log-probs, when computed
    rollout = torch.tensor([[math.log(0.5), 0.0, math.log(1.1)]], dtype=F64)  # ratios 2, 1, 1/1.1
    adv = torch.ones(1, 3, dtype=F64)
    mask = torch.ones(1, 3)
    cfg = LossConfig(use_rollout_logprobs=True, calculate_per_token_loss=True)
    loss, m = policy_loss(logp, None, adv, mask, cfg, rollout_logp=rollout)
    assert loss.item() == pytest.approx(-(1.2 + 1.0 + 1 / 1.1) / 3, abs=1e-12)  # 2 clipped at 1.2
    assert m["pg_clipfrac"].item() == pytest.approx(1 / 3, abs=1e-12)
    assert m["ppo_kl"].item() == pytest.approx((math.log(0.5) + math.log(1.1)) / 3, abs=1e-12)
    # Compared with the rollout: the current log-probs (the trainer's were not recomputed).
    assert m["train_rollout_logprob_abs_diff"].item() == pytest.approx(
        (math.log(2) + math.log(1.1)) / 3, abs=1e-12
    )
    assert "tis" not in m and "mis_kl" not in m  # nothing to compare the rollout with
    loss.backward()
    torch.testing.assert_close(
        logp.grad, torch.tensor([[0.0, -1 / 3, -1 / 3.3]], dtype=F64), atol=1e-12, rtol=0
    )
    # The trainer's log-probs given too: the ratio is still the rollout's; they feed the metrics.
    both = LossConfig(
        use_rollout_logprobs=True, get_mismatch_metrics=True, calculate_per_token_loss=True
    )
    loss2, m2 = policy_loss(logp.detach(), trainer, adv, mask, both, rollout_logp=rollout)
    assert loss2.item() == pytest.approx(loss.item(), abs=1e-12)
    kl = (math.log(0.5) + math.log(1.1)) / 3 - 0.25  # mean(rollout - trainer)
    assert m2["mis_kl"].item() == pytest.approx(kl, abs=1e-12)
    # slime compares the current log-probs with the rollout's in this mode, not the trainer's old.
    assert m2["train_rollout_logprob_abs_diff"].item() == pytest.approx(
        m["train_rollout_logprob_abs_diff"].item(), abs=1e-12
    )
    # Without the flag the trainer's log-probs are the reference: ratio exp(-0.25) everywhere.
    loss3, m3 = policy_loss(
        logp.detach(),
        trainer,
        adv,
        mask,
        LossConfig(calculate_per_token_loss=True),
        rollout_logp=rollout,
    )
    assert loss3.item() == pytest.approx(-math.exp(-0.25), abs=1e-12)
    assert m3["ppo_kl"].item() == pytest.approx(0.25, abs=1e-12)
    with pytest.raises(ValueError, match="--use-rollout-logprobs needs rollout_logp"):
        policy_loss(logp, None, adv, mask, cfg)
    with pytest.raises(ValueError, match="old_logp is needed"):
        policy_loss(logp, None, adv, mask, LossConfig(), rollout_logp=rollout)


def test_flags_that_need_the_rollouts_log_probs_are_checked():
    with pytest.raises(ValueError, match="--use-rollout-logprobs and --use-tis cannot be set"):
        LossConfig(use_rollout_logprobs=True, use_tis=True)
    LossConfig().check_rollout_log_probs(False)
    cfg = LossConfig(use_rollout_logprobs=True, get_mismatch_metrics=True)
    cfg.check_rollout_log_probs(True)
    with pytest.raises(
        ValueError,
        match="--use-rollout-logprobs and --get-mismatch-metrics need the rollout's log-probs, "
        "but samples of this rollout carry none",
    ):
        cfg.check_rollout_log_probs(False)
    assert cfg.recomputes_log_probs
    assert not LossConfig(use_rollout_logprobs=True).recomputes_log_probs
    assert LossConfig().recomputes_log_probs
