"""trainer_bridge.loss against hand-computed values."""

import argparse
import math

import pytest
import torch

from trainer_bridge.loss import (
    LossConfig,
    add_cli_args,
    aggregate,
    compute_advantages,
    entropy_from_logits,
    from_args,
    group_advantages,
    kl_penalty,
    policy_loss,
    ppo_clip_loss,
    token_log_probs,
)

F64 = torch.float64


def t(values, requires_grad: bool = False) -> torch.Tensor:
    return torch.tensor(values, dtype=F64, requires_grad=requires_grad)


def leaf(values) -> torch.Tensor:
    """A float64 leaf that requires grad, built from values that may need log()."""
    return torch.as_tensor(values, dtype=F64).clone().requires_grad_(True)


def close(actual: torch.Tensor, expected, atol: float = 1e-12) -> None:
    torch.testing.assert_close(
        actual.double(), torch.tensor(expected, dtype=F64), atol=atol, rtol=0
    )


def ones_mask(*shape: int) -> torch.Tensor:
    return torch.ones(*shape, dtype=torch.bool)


# ---------------------------------------------------------------- PPO clipping


def test_ppo_clip_inside_above_below_range():
    # ratio, advantage -> per-token loss, clipped?
    # 1.0, +1 -> -1.0 no | 1.5, +1 -> -1.2 yes | 0.5, +1 -> -0.5 no | 1.5, -1 -> 1.5 no | 0.5, -1 ->
    # 0.8 yes
    ratios = t([[1.0, 1.5, 0.5, 1.5, 0.5]])
    logp = leaf(ratios.log())
    adv = t([[1.0, 1.0, 1.0, -1.0, -1.0]])
    cfg = LossConfig(calculate_per_token_loss=True)
    loss, m = policy_loss(logp, torch.zeros_like(logp), adv, ones_mask(1, 5), cfg)
    assert loss.item() == pytest.approx((-1.0 - 1.2 - 0.5 + 1.5 + 0.8) / 5, abs=1e-12)
    assert m["pg_clipfrac"].item() == pytest.approx(0.4, abs=1e-12)
    assert m["ppo_kl"].item() == pytest.approx(-2 * math.log(0.75) / 5, abs=1e-12)
    loss.backward()
    # d(-A * r)/d logp = -A * r where unclipped, 0 where clipped; /5 for the token mean
    close(logp.grad, [[-0.2, 0.0, -0.1, 0.3, 0.0]], 1e-12)


def test_asymmetric_clip_uses_eps_clip_high_above_one():
    ratios = t([1.25, 1.3, 0.75])
    adv = t([1.0, 1.0, -1.0])
    losses, clipped, _ = ppo_clip_loss(ratios.log(), adv, eps_clip=0.2, eps_clip_high=0.28)
    assert losses.tolist() == pytest.approx([-1.25, -1.28, 0.8], abs=1e-12)
    assert clipped.tolist() == [0.0, 1.0, 1.0]
    symmetric, clipped_sym, _ = ppo_clip_loss(ratios.log(), adv, eps_clip=0.2)
    assert symmetric.tolist() == pytest.approx([-1.2, -1.2, 0.8], abs=1e-12)
    assert clipped_sym.tolist() == [1.0, 1.0, 1.0]
    assert LossConfig(eps_clip=0.2).clip_high == 0.2
    assert LossConfig(eps_clip=0.2, eps_clip_high=0.28).clip_high == 0.28


def test_dual_clip_caps_negative_advantage_loss():
    # ratio 5, A=-1: PPO keeps 5, dual clip caps it at c=3 | ratio 2, A=-1: 2 < 3 kept | ratio 5,
    # A=+1: -1.2
    logp = leaf(t([[5.0, 2.0, 5.0]]).log())
    adv = t([[-1.0, -1.0, 1.0]])
    cfg = LossConfig(eps_clip_c=3.0, calculate_per_token_loss=True)
    loss, m = policy_loss(logp, torch.zeros_like(logp), adv, ones_mask(1, 3), cfg)
    assert loss.item() == pytest.approx((3.0 + 2.0 - 1.2) / 3, abs=1e-12)
    assert m["pg_clipfrac"].item() == pytest.approx(1 / 3, abs=1e-12)
    assert m["pg_clipfrac_lower"].item() == pytest.approx(1 / 3, abs=1e-12)
    loss.backward()
    close(logp.grad, [[0.0, 2.0 / 3, 0.0]], 1e-12)
    without, _, dual = ppo_clip_loss(logp.detach(), adv, 0.2)
    close(without, [[5.0, 2.0, -1.2]], 1e-12)
    assert dual.tolist() == [[0.0, 0.0, 0.0]]


# ---------------------------------------------------------------- TIS


def test_tis_weights_capped_and_detached():
    old = t([[0.5, 1.0, 3.0]]).log()  # exp(old - rollout) = 0.5, 1, 3
    rollout = torch.zeros(1, 3, dtype=F64, requires_grad=True)
    logp = leaf(old)  # on-policy: ratio 1
    adv = t([[1.0, 1.0, 1.0]])
    cfg = LossConfig(use_tis=True, calculate_per_token_loss=True)
    loss, m = policy_loss(logp, old, adv, ones_mask(1, 3), cfg, rollout_logp=rollout)
    assert loss.item() == pytest.approx(-(0.5 + 1.0 + 2.0) / 3, abs=1e-12)
    assert m["tis"].item() == pytest.approx(1.5, abs=1e-12)
    assert m["tis_weight"].item() == pytest.approx(3.5 / 3, abs=1e-12)
    assert m["tis_clipfrac"].item() == pytest.approx(1 / 3, abs=1e-12)
    loss.backward()
    close(logp.grad, [[-0.5 / 3, -1 / 3, -2 / 3]], 1e-12)
    assert rollout.grad is None

    low = LossConfig(use_tis=True, tis_clip_low=0.6, calculate_per_token_loss=True)
    loss_low, m_low = policy_loss(leaf(old), old, adv, ones_mask(1, 3), low, rollout_logp=rollout)
    assert loss_low.item() == pytest.approx(-(0.6 + 1.0 + 2.0) / 3, abs=1e-12)
    assert m_low["tis_clipfrac"].item() == pytest.approx(2 / 3, abs=1e-12)

    # Without --use-tis the weights are reported but not applied.
    plain, m_plain = policy_loss(
        leaf(old),
        old,
        adv,
        ones_mask(1, 3),
        LossConfig(calculate_per_token_loss=True),
        rollout_logp=rollout,
    )
    assert plain.item() == pytest.approx(-1.0, abs=1e-12)
    assert m_plain["tis_weight"].item() == pytest.approx(3.5 / 3, abs=1e-12)
    with pytest.raises(ValueError, match="rollout_logp"):
        policy_loss(leaf(old), old, adv, ones_mask(1, 3), cfg)


# ---------------------------------------------------------------- GSPO


def test_gspo_sequence_ratio_matches_hand_values_and_sequence_form_gradient():
    old = t([[-1.0, -2.0, -3.0], [-1.0, -1.0, -1.0]])
    # sequence 0: diffs 0.1, -0.3 (third token masked, garbage diff 50) -> mean -0.1, ratio e^-0.1
    # inside the clip
    # sequence 1: diffs 0.2, 0.4, 0.6 -> mean 0.4, ratio e^0.4 = 1.49 > 1.2: clipped
    diffs = t([[0.1, -0.3, 50.0], [0.2, 0.4, 0.6]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]], dtype=torch.bool)
    adv = t([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    logp = leaf(old + diffs)
    cfg = LossConfig(advantage_estimator="gspo")
    loss, m = policy_loss(logp, old, adv, mask, cfg)
    r0 = math.exp(-0.1)
    assert loss.item() == pytest.approx((-r0 - 1.2) / 2, abs=1e-12)
    assert m["pg_clipfrac"].item() == pytest.approx(0.5, abs=1e-12)
    assert m["ppo_kl"].item() == pytest.approx((0.1 - 0.4) / 2, abs=1e-12)
    loss.backward()
    # d(-r0)/d logp_t = -r0 / 2 tokens, / 2 sequences; the clipped sequence gets none.
    close(logp.grad, [[-r0 / 4, -r0 / 4, 0.0], [0.0, 0.0, 0.0]], 1e-12)

    # slime's form: the sequence ratio differentiated through the mean, broadcast to tokens.
    direct = leaf(old + diffs)
    seq = torch.where(mask, direct - old, 0.0).sum(-1) / mask.sum(-1)
    ratio = seq.exp()
    seq_adv = t([1.0, 1.0])
    surrogate = torch.maximum(-seq_adv * ratio, -seq_adv * ratio.clamp(0.8, 1.2))
    surrogate.mean().backward()
    torch.testing.assert_close(logp.grad, direct.grad, atol=1e-12, rtol=0)

    # Token-level PPO on the same data differs: token 1 of sequence 1 has ratio e^0.4 and
    # token 0 of sequence 0 has e^0.1, so the GSPO test above can fail.
    token_loss, _ = policy_loss(old + diffs, old, adv, mask, LossConfig())
    assert token_loss.item() != pytest.approx(loss.item(), abs=1e-6)


# ---------------------------------------------------------------- KL and entropy


def test_kl_estimators_hand_values():
    logp, ref = t([-1.0, -2.0, -21.0]), t([-2.0, -1.5, -1.0])  # log-ratios 1, -0.5, -20
    assert kl_penalty(logp, ref, "k1").tolist() == pytest.approx([1.0, -0.5, -20.0], abs=1e-12)
    assert kl_penalty(logp, ref, "k2").tolist() == pytest.approx([0.5, 0.125, 200.0], abs=1e-12)
    k3 = [math.exp(-1.0), math.exp(0.5) - 1.5, math.exp(20.0) - 21.0]
    assert kl_penalty(logp, ref, "k3").tolist() == pytest.approx(k3, rel=1e-12)
    assert kl_penalty(logp, ref, "low_var_kl").tolist() == pytest.approx(k3[:2] + [10.0], rel=1e-12)
    with pytest.raises(ValueError, match="'k4'.*k1, k2, k3, low_var_kl"):
        kl_penalty(logp, ref, "k4")


def test_kl_loss_added_only_with_use_kl_loss():
    logp = leaf([[-1.0, -2.0]])
    ref = t([[-2.0, -1.5]])  # k3 per token: e^-1, e^0.5 - 1.5
    adv = t([[1.0, 1.0]])
    k3_mean = (math.exp(-1.0) + math.exp(0.5) - 1.5) / 2
    cfg = LossConfig(use_kl_loss=True, kl_loss_coef=0.1, kl_loss_type="k3")
    loss, m = policy_loss(logp, logp.detach(), adv, ones_mask(1, 2), cfg, ref_logp=ref)
    assert m["kl"].item() == pytest.approx(k3_mean, abs=1e-12)
    assert loss.item() == pytest.approx(-1.0 + 0.1 * k3_mean, abs=1e-12)
    no_kl_loss = LossConfig(kl_loss_type="k3", kl_loss_coef=0.1)
    metric_only, m2 = policy_loss(
        logp, logp.detach(), adv, ones_mask(1, 2), no_kl_loss, ref_logp=ref
    )
    assert metric_only.item() == pytest.approx(-1.0, abs=1e-12)
    assert m2["kl"].item() == pytest.approx(k3_mean, abs=1e-12)
    with pytest.raises(ValueError, match="ref_logp"):
        policy_loss(logp, logp.detach(), adv, ones_mask(1, 2), cfg)


def test_entropy_and_log_probs_against_direct_computation():
    torch.manual_seed(0)
    logits = torch.randn(2, 3, 7, dtype=F64) * 3
    for temperature in (1.0, 0.5):
        p = torch.softmax(logits / temperature, dim=-1)
        direct = -(p * p.log()).sum(-1)
        torch.testing.assert_close(
            entropy_from_logits(logits, temperature), direct, atol=1e-12, rtol=0
        )
    tokens = torch.tensor([[0, 3, 6], [1, 1, 2]])
    direct_lp = torch.log_softmax(logits / 0.7, dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(token_log_probs(logits, tokens, 0.7), direct_lp, atol=1e-12, rtol=0)
    # bf16 logits are computed in float32, close to the float64 reference
    low = token_log_probs(logits.bfloat16(), tokens, 0.7)
    assert (
        low.dtype == torch.float32 and entropy_from_logits(logits.bfloat16()).dtype == torch.float32
    )
    torch.testing.assert_close(low.double(), direct_lp, atol=0.1, rtol=0)

    banned = torch.tensor([[0.0, 0.0, float("-inf")]], requires_grad=True)
    h = entropy_from_logits(banned)
    assert h.item() == pytest.approx(math.log(2), abs=1e-6)
    h.sum().backward()
    assert torch.isfinite(banned.grad).all()


def test_entropy_bonus_subtracted_from_loss():
    logp = leaf([[0.0, 0.0]])
    entropy = leaf([[2.0, 4.0]])
    cfg = LossConfig(entropy_coef=0.01, calculate_per_token_loss=True)
    loss, m = policy_loss(
        logp, logp.detach(), t([[1.0, 1.0]]), ones_mask(1, 2), cfg, entropy=entropy
    )
    assert m["entropy_loss"].item() == pytest.approx(3.0, abs=1e-12)
    assert loss.item() == pytest.approx(-1.0 - 0.03, abs=1e-12)
    loss.backward()
    close(entropy.grad, [[-0.005, -0.005]], 1e-12)
    with pytest.raises(ValueError, match="entropy_coef=0.01"):
        policy_loss(logp, logp.detach(), t([[1.0, 1.0]]), ones_mask(1, 2), cfg)


# ---------------------------------------------------------------- advantages


def test_grpo_group_advantages():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 0.0])
    adv = group_advantages(rewards, 4)
    s = 0.5 / math.sqrt(
        1 / 3
    )  # group 0: mean 0.5, unbiased std sqrt(1/3); group 1: mean 0.75, std 0.5
    assert adv.tolist() == pytest.approx([s, -s, -s, s, 0.5, 0.5, 0.5, -1.5], abs=1e-5)
    groups = adv.view(2, 4)
    assert groups.mean(-1).tolist() == pytest.approx([0.0, 0.0], abs=1e-6)
    assert groups.std(-1).tolist() == pytest.approx([1.0, 1.0], abs=1e-5)

    dr = group_advantages(rewards, 4, std_normalization=False)
    assert dr.tolist() == pytest.approx([0.5, -0.5, -0.5, 0.5, 0.25, 0.25, 0.25, -0.75], abs=1e-7)
    assert group_advantages(torch.ones(4), 4).tolist() == [0.0] * 4
    assert group_advantages(torch.tensor([3.0, 5.0]), 1).tolist() == [0.0, 0.0]
    with pytest.raises(ValueError, match="5 rewards.*n_samples_per_prompt=2"):
        group_advantages(torch.ones(5), 2)


def test_compute_advantages_broadcast_mask_and_estimators():
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [0, 1, 1]])
    s = 0.5 / math.sqrt(0.5)
    adv = compute_advantages(rewards, mask, LossConfig(), n_samples_per_prompt=2)
    close(adv, [[s, s, 0], [-s, 0, 0], [0, 0, 0], [0, 0, 0]], 1e-5)

    rpp = LossConfig(advantage_estimator="reinforce_plus_plus_baseline", kl_coef=0.5)
    kl = torch.full((4, 3), 0.2)
    adv = compute_advantages(rewards, mask, rpp, 2, kl=kl)  # mean-centred only, minus 0.5 * kl
    close(adv, [[0.4, 0.4, 0], [-0.6, 0, 0], [-0.1, -0.1, -0.1], [0, -0.1, -0.1]], 1e-6)
    with pytest.raises(ValueError, match="kl_coef=0.5"):
        compute_advantages(rewards, mask, rpp, 2)

    raw = compute_advantages(rewards, mask, LossConfig(rewards_normalization=False), 2)
    assert raw.tolist() == [[1, 1, 0], [0, 0, 0], [1, 1, 1], [0, 1, 1]]

    white = compute_advantages(
        rewards, mask, LossConfig(rewards_normalization=False, normalize_advantages=True), 2
    )
    kept = white[mask.bool()]
    assert kept.mean().item() == pytest.approx(0.0, abs=1e-6)
    assert kept.pow(2).mean().item() == pytest.approx(1.0, abs=1e-5)
    # 7 ones and 1 zero among unmasked tokens: mean 7/8, biased std sqrt(7)/8
    assert white[1, 0].item() == pytest.approx(-(7 / 8) / (math.sqrt(7) / 8), abs=1e-5)
    assert white[1, 1].item() == 0.0


# ---------------------------------------------------------------- masks and aggregation


def test_aggregation_modes_with_mask():
    values = t([[1.0, 2.0, 3.0, float("nan")], [10.0, 20.0, 30.0, 40.0]])
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 0]])
    assert aggregate(values, mask, "token-mean").item() == pytest.approx(63 / 5, abs=1e-12)
    assert aggregate(values, mask, "seq-mean-token-mean").item() == pytest.approx(
        (1.5 + 20) / 2, abs=1e-12
    )
    assert aggregate(values, mask, "seq-mean-token-sum").item() == pytest.approx(
        (3 + 60) / 2, abs=1e-12
    )
    # Micro-batches reduced with the global denominator add up to the full-batch value.
    halves = sum(
        aggregate(values[i : i + 1], mask[i : i + 1], "token-mean", normalizer=5) for i in range(2)
    )
    assert halves.item() == pytest.approx(63 / 5, abs=1e-12)
    seq_halves = sum(
        aggregate(values[i : i + 1], mask[i : i + 1], "seq-mean-token-mean", normalizer=2)
        for i in range(2)
    )
    assert seq_halves.item() == pytest.approx(10.75, abs=1e-12)
    # A fully masked sample contributes 0 but still counts as a sample.
    empty = torch.tensor([[1, 1, 0, 0], [0, 0, 0, 0]])
    assert aggregate(values, empty, "seq-mean-token-mean").item() == pytest.approx(0.75, abs=1e-12)
    with pytest.raises(ValueError, match="'mean'.*token-mean"):
        aggregate(values, mask, "mean")


def test_policy_loss_masked_tokens_ignored_and_config_selects_aggregation():
    # Padding positions hold garbage log-probs (the ratio would overflow) and must not matter.
    logp = leaf([[0.0, 0.0, 500.0], [0.0, 0.0, 0.0]])
    old = t([[0.0, 0.0, -500.0], [0.0, 0.0, 0.0]])
    adv = t([[1.0, 3.0, 0.0], [2.0, 2.0, 2.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    token_loss, _ = policy_loss(logp, old, adv, mask, LossConfig(calculate_per_token_loss=True))
    assert token_loss.item() == pytest.approx(-(1 + 3 + 6) / 5, abs=1e-12)
    seq_loss, _ = policy_loss(logp, old, adv, mask, LossConfig())
    assert seq_loss.item() == pytest.approx(-(2 + 2) / 2, abs=1e-12)
    sum_loss, _ = policy_loss(logp, old, adv, mask, LossConfig(loss_agg_mode="seq-mean-token-sum"))
    assert sum_loss.item() == pytest.approx(-(4 + 6) / 2, abs=1e-12)
    seq_loss.backward()
    close(logp.grad, [[-0.25, -0.75, 0.0], [-1 / 3, -1 / 3, -1 / 3]], 1e-12)


def test_gradients_flow_only_through_logp_and_entropy():
    torch.manual_seed(1)
    logp = leaf(torch.randn(2, 4) * 0.1 - 1)
    others = {name: leaf(torch.randn(2, 4) * 0.1 - 1) for name in ("old", "ref", "rollout")}
    adv = leaf(torch.randn(2, 4))
    entropy = leaf(torch.rand(2, 4))
    cfg = LossConfig(
        use_kl_loss=True, kl_loss_coef=0.1, use_tis=True, entropy_coef=0.01, eps_clip_c=3.0
    )
    loss, metrics = policy_loss(
        logp,
        others["old"],
        adv,
        ones_mask(2, 4),
        cfg,
        ref_logp=others["ref"],
        rollout_logp=others["rollout"],
        entropy=entropy,
    )
    loss.backward()
    assert logp.grad is not None and logp.grad.abs().sum() > 0
    assert entropy.grad is not None and entropy.grad.abs().sum() > 0
    assert adv.grad is None and all(x.grad is None for x in others.values())
    assert not any(v.requires_grad for v in metrics.values())
    assert set(metrics) == {
        "loss",
        "pg_loss",
        "pg_clipfrac",
        "pg_clipfrac_lower",
        "ppo_kl",
        "entropy_loss",
        "kl",
        "tis",
        "tis_weight",
        "tis_clipfrac",
        "tis_abs",
        "ois",
        "train_rollout_logprob_abs_diff",
    }
    assert metrics["loss"].item() == loss.item()


# ---------------------------------------------------------------- config and flags


def test_argparse_round_trip_with_slime_flag_names():
    parser = argparse.ArgumentParser()
    add_cli_args(parser)
    # Each flag also has an underscore spelling (--eps_clip), as every generated flag does.
    flags = {s for a in parser._actions for s in a.option_strings if "_" not in s} - {
        "-h",
        "--help",
    }
    assert flags == {
        "--advantage-estimator",
        "--disable-rewards-normalization",
        "--disable-grpo-std-normalization",
        "--normalize-advantages",
        "--eps-clip",
        "--eps-clip-high",
        "--eps-clip-c",
        "--kl-coef",
        "--use-kl-loss",
        "--kl-loss-coef",
        "--kl-loss-type",
        "--entropy-coef",
        "--use-tis",
        "--tis-clip",
        "--tis-clip-low",
        "--use-rollout-logprobs",
        "--get-mismatch-metrics",
        "--calculate-per-token-loss",
        "--loss-agg-mode",
    }
    default = from_args(parser.parse_args([]))
    assert default == LossConfig()
    assert (default.eps_clip, default.eps_clip_high, default.kl_loss_type, default.tis_clip) == (
        0.2,
        None,
        "k1",
        2.0,
    )
    assert default.loss_agg_mode == "seq-mean-token-mean"

    cfg = from_args(
        parser.parse_args(
            [
                "--advantage-estimator",
                "gspo",
                "--eps-clip",
                "0.1",
                "--eps-clip-high",
                "0.3",
                "--eps-clip-c",
                "3",
                "--use-kl-loss",
                "--kl-loss-coef",
                "0.01",
                "--kl-loss-type",
                "low_var_kl",
                "--entropy-coef",
                "0.001",
                "--use-tis",
                "--tis-clip",
                "3",
                "--tis-clip-low",
                "0.5",
                "--calculate-per-token-loss",
                "--disable-grpo-std-normalization",
                "--disable-rewards-normalization",
                "--normalize-advantages",
            ]
        )
    )
    assert cfg == LossConfig(
        advantage_estimator="gspo",
        eps_clip=0.1,
        eps_clip_high=0.3,
        eps_clip_c=3.0,
        use_kl_loss=True,
        kl_loss_coef=0.01,
        kl_loss_type="low_var_kl",
        entropy_coef=0.001,
        use_tis=True,
        tis_clip=3.0,
        tis_clip_low=0.5,
        loss_agg_mode="token-mean",
        calculate_per_token_loss=True,
        grpo_std_normalization=False,
        rewards_normalization=False,
        normalize_advantages=True,
    )
    assert cfg.loss_agg_mode == "token-mean"
    with pytest.raises(SystemExit):
        parser.parse_args(["--kl-loss-type", "k4"])


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(eps_clip_c=0.5), "--eps-clip-c must be > 1.*0.5"),
        (dict(eps_clip=-0.1), "--eps-clip must be >= 0.*-0.1"),
        (dict(tis_clip=0.5, tis_clip_low=1.0), r"--tis-clip \(0.5\).*--tis-clip-low \(1.0\)"),
        (dict(kl_coef=0.1), "--kl-coef 0.1 .*--use-kl-loss"),
        (
            dict(advantage_estimator="ppo"),
            "--advantage-estimator must be one of grpo, gspo, reinforce_plus_plus_baseline; got "
            "'ppo'",
        ),
        (dict(kl_loss_type="kl"), "k1, k2, k3, low_var_kl; got 'kl'"),
        (
            dict(calculate_per_token_loss=True, loss_agg_mode="seq-mean-token-sum"),
            "seq-mean-token-sum",
        ),
    ],
)
def test_config_validation_names_the_bad_value(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LossConfig(**kwargs)
