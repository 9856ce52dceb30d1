"""TrainActor on megatron-core (CPU, gloo): log-probs equal the engine's, GRPO steps move the
policy toward rewarded responses, the MTP loss trains only MTP layers, and the exported weights
land in an engine bit for bit."""

from __future__ import annotations

import math

import pytest
import torch

from spec_engine import Engine
from tests.conftest import random_prompts
from tiny.checkpoints import add_mimo_mtp
from trainer_bridge.drafts.mtp_loss import mtp_loss
from trainer_bridge.loss import LossConfig
from trainer_bridge.micro_batches.layout import PaddedMicroBatch

pytest.importorskip("megatron.core")


@pytest.fixture(scope="module")
def mimo(make_model):
    return add_mimo_mtp(make_model("qwen2", num_layers=2, seed=31), seed=32)


@pytest.fixture(scope="module")
def actor(mimo):
    from trainer_bridge.actor import TrainActor
    from trainer_bridge.megatron_compat import destroy_model_parallel
    from trainer_bridge.options import TrainerArgs

    a = TrainActor(
        TrainerArgs(hf_checkpoint=mimo, lr=2e-3, micro_batch_size=3, enable_mtp_training=True),
        LossConfig(),
        temperature=1.0,
    )
    yield a
    destroy_model_parallel()


def rollout(engine_path, n=4, **engine_kwargs):
    prompts = random_prompts(2, 5, 9, seed=33)
    params = {"temperature": 1.0, "max_new_tokens": 6, "ignore_eos": True, "n": n}
    with Engine(model_path=engine_path, random_seed=3, **engine_kwargs) as engine:
        outs = engine.generate(input_ids=prompts, sampling_params=params, return_logprob=True)
    groups = [outs[i * n : (i + 1) * n] for i in range(len(prompts))]
    tokens, lengths, logps = [], [], []
    for prompt, group in zip(prompts, groups):
        for o in group:
            tokens.append(prompt + o["output_ids"])
            lengths.append(len(o["output_ids"]))
            logps.append([lp for lp, _, _ in o["meta_info"]["output_token_logprobs"]])
    return tokens, lengths, logps


def test_bf16_without_cuda_is_refused(mimo):
    from trainer_bridge.actor import TrainActor
    from trainer_bridge.options import TrainerArgs

    if torch.cuda.is_available():
        pytest.skip("CUDA present: bf16 is allowed")
    with pytest.raises(ValueError, match="--bf16 needs CUDA"):
        TrainActor(TrainerArgs(hf_checkpoint=mimo, bf16=True))


def test_trainer_log_probs_equal_the_engines(actor, mimo):
    from trainer_bridge.batch import TrainBatch

    tokens, lengths, engine_logps = rollout(
        mimo, speculative_algorithm="EAGLE", speculative_num_steps=2, speculative_eagle_topk=1
    )
    got = actor.compute_log_probs(TrainBatch(tokens, lengths, [0.0] * len(tokens)))
    diff = max(abs(a - b) for x, y in zip(got, engine_logps) for a, b in zip(x, y))
    assert diff < 1e-4, diff


def test_mtp_loss_reaches_only_mtp_parameters(actor):
    tokens = torch.randint(5, 300, (2, 12))
    mask = torch.zeros(2, 11)
    mask[:, 4:] = 1
    actor.model.zero_grad_buffer()
    actor.model.train()
    batch = PaddedMicroBatch(tokens)
    _, hidden = actor._forward(batch)
    mtp_loss(actor.gpt, actor.arch.vocab_size, batch, hidden, mask).backward()
    grads = {
        n: p.main_grad.abs().sum().item()
        for n, p in actor.gpt.named_parameters()
        if p.requires_grad
    }
    trunk = {n: g for n, g in grads.items() if not n.startswith("mtp.")}
    mtp = {n: g for n, g in grads.items() if n.startswith("mtp.")}
    assert trunk and mtp
    assert all(g == 0 for g in trunk.values()), [n for n, g in trunk.items() if g][:3]
    assert (
        sum(g > 0 for g in mtp.values()) >= len(mtp) - 2
    )  # every MTP weight but maybe a norm learns
    actor.model.zero_grad_buffer()


def test_grpo_steps_raise_rewarded_responses(actor, mimo):
    from trainer_bridge.batch import TrainBatch

    tokens, lengths, logps = rollout(mimo)
    # Reward: the response's first token is even. Groups then mix rewards (checked).
    rewards = [float(t[len(t) - n] % 2 == 0) for t, n in zip(tokens, lengths)]
    assert 0 < sum(rewards[:4]) < 4 or 0 < sum(rewards[4:]) < 4
    batch = TrainBatch(tokens, lengths, rewards, rollout_log_probs=logps, n_samples_per_prompt=4)

    def first_token_logp():
        lp = actor.compute_log_probs(batch)
        good = [x[0] for x, r in zip(lp, rewards) if r == 1.0]
        bad = [x[0] for x, r in zip(lp, rewards) if r == 0.0]
        return sum(good) / len(good), sum(bad) / len(bad)

    good0, bad0 = first_token_logp()
    for _ in range(3):
        metrics = actor.train(batch)
        assert math.isfinite(metrics["train/grad_norm"]) and metrics["train/grad_norm"] > 0
        assert "train/mtp_loss" in metrics and math.isfinite(metrics["train/mtp_loss"])
    good1, bad1 = first_token_logp()
    assert good1 > good0 + 0.05 and bad1 < bad0, (good0, good1, bad0, bad1)


def test_exported_weights_land_in_an_engine(actor, mimo, tmp_path):
    from spec_engine.weights.loader import tensor_checksum
    from trainer_bridge.weight_sync import WeightPusher, WeightSyncConfig

    path = str(tmp_path / "hf")
    actor.save_hf(path)
    sent = dict(actor.hf_named_tensors())
    assert any(".mtp_layers." in n for n in sent)
    spec = dict(speculative_algorithm="EAGLE", speculative_num_steps=2, speculative_eagle_topk=1)
    prompts = random_prompts(2, 4, 10, seed=35)
    greedy = {"temperature": 0.0, "max_new_tokens": 8, "ignore_eos": True}
    with Engine(model_path=path, random_seed=0, **spec) as fresh:
        expected = [
            o["output_ids"] for o in fresh.generate(input_ids=prompts, sampling_params=greedy)
        ]
    with Engine(model_path=mimo, random_seed=0, **spec) as engine:
        pusher = WeightPusher([engine], WeightSyncConfig(check_weight_update_equal=True))
        pusher.push(actor.hf_named_tensors(), version="step-3")
        pusher.close()
        assert engine.get_weights_checksum(list(sent)) == {
            n: tensor_checksum(t) for n, t in sent.items()
        }
        assert [
            o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params=greedy)
        ] == expected
    # The oracle nobody here wrote: transformers on the exported checkpoint (its Qwen2 trunk).
    from transformers import Qwen2ForCausalLM

    hf = Qwen2ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    for prompt, want in zip(prompts, expected):
        out = hf.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=8,
            do_sample=False,
            min_new_tokens=8,
        )
        assert out[0, len(prompt) :].tolist() == want


def test_token_mean_losses_do_not_depend_on_micro_batch_size(actor):
    """SFT (a token mean) gives the same trunk gradient in micro batches of 1 and of 4."""
    from trainer_bridge.batch import TrainBatch

    g = torch.Generator().manual_seed(7)
    lengths = [1, 2, 5, 7]  # unequal, so a per-micro-batch mean would weight tokens differently
    tokens = [torch.randint(5, 300, (6 + n,), generator=g).tolist() for n in lengths]
    batch = TrainBatch(tokens, lengths, [0.0] * 4)
    step, mbs = actor.optimizer.step, actor.args.micro_batch_size
    actor.optimizer.step = lambda: (True, 0.0, None)  # keep the weights: compare gradients only
    grads = []
    try:
        for size in (1, 4):
            actor.args.micro_batch_size = size
            actor.train_sft(batch)
            grads.append(
                torch.cat(
                    [
                        p.main_grad.flatten().clone()
                        for n, p in actor.gpt.named_parameters()
                        if p.requires_grad and not n.startswith("mtp.")
                    ]
                )
            )
    finally:
        actor.optimizer.step, actor.args.micro_batch_size = step, mbs
        actor.model.zero_grad_buffer()
    assert grads[0].abs().sum() > 0
    assert torch.allclose(grads[0], grads[1], atol=1e-6), (grads[0] - grads[1]).abs().max()


def test_pad_batch_puts_per_token_values_at_the_positions_that_score_the_response():
    """Position t scores token t + 1: a response of n tokens ending a sequence of length L is
    scored at positions L - n - 1 .. L - 2; a per-token list of the wrong length is refused."""
    from trainer_bridge.batch import TrainBatch, pad_batch

    batch = TrainBatch(
        tokens=[[7, 8, 9, 10], [11, 12]],
        response_lengths=[2, 1],
        rewards=[1.0, 0.0],
        loss_masks=[[1, 0], [1]],
        rollout_log_probs=[[-0.5, -1.5], [-2.0]],
    )
    tokens, mask, rollout = pad_batch(batch, torch.device("cpu"))
    assert tokens.tolist() == [[7, 8, 9, 10], [11, 12, 0, 0]]
    assert mask.tolist() == [[0.0, 1.0, 0.0], [1.0, 0.0, 0.0]]
    assert rollout.tolist() == [[0.0, -0.5, -1.5], [-2.0, 0.0, 0.0]]
    batch.loss_masks = [[1, 0, 1], [1]]
    with pytest.raises(ValueError, match="sequence 0 has 2 response tokens but 3"):
        pad_batch(batch, torch.device("cpu"))


def test_mismatch_metrics_and_rollout_logprobs_through_a_train_step(actor, mimo, monkeypatch):
    """--get-mismatch-metrics in a real step: zero mismatch when the rollout's log-probs are the
    trainer's own, and, with them moved by a known d per sequence (masked tokens by 30, which
    must count nowhere), the metrics slime's definitions give; then
    --use-rollout-logprobs: the ratio's reference is the rollout's (ppo_kl = mean d, not 0) and the
    trainer's old log-prob forward is skipped unless the mismatch metrics need it."""
    from rollout.sample import Sample
    from specrl.train_batch import to_train_batch
    from trainer_bridge import loss as losses
    from trainer_bridge.batch import TrainBatch, pad_batch

    tokens, lengths, _ = rollout(mimo)
    n = len(tokens)
    # The trainer's log-probs, not the engine's: earlier tests here have moved the weights.
    logps = actor.compute_log_probs(TrainBatch(tokens, lengths, [0.0] * n))
    d = [0.0, 0.2, -0.3, 1.0, -1.0, 0.5, 2.0, -0.1][:n]  # TIS ratios exp(-d)
    masks = [[0] + [1] * (k - 1) if k > 1 else [1] for k in lengths]
    moved = [
        [lp + (di if m else 30.0) for lp, m in zip(lps, mask)]
        for lps, mask, di in zip(logps, masks, d)
    ]
    rewards = [float(i % 2) for i in range(n)]

    def step(cfg, log_probs, *, count=None):
        batch = TrainBatch(tokens, lengths, rewards, masks, log_probs, n_samples_per_prompt=4)
        saved = actor.loss_cfg, actor.optimizer.step, actor._logp_matrix
        actor.loss_cfg = cfg
        actor.optimizer.step = lambda: (True, 0.0, None)  # keep the weights
        if count is not None:
            actor._logp_matrix = lambda *a, **k: (count.append(1), saved[2](*a, **k))[1]
        try:
            return actor.train(batch)
        finally:
            actor.loss_cfg, actor.optimizer.step, actor._logp_matrix = saved
            actor.model.zero_grad_buffer()

    same = step(LossConfig(get_mismatch_metrics=True), logps)
    assert same["train/train_rollout_logprob_abs_diff"] < 1e-4
    assert abs(same["train/mis_kl"]) < 1e-4 and abs(same["train/mis_k3_kl"]) < 1e-6
    assert same["train/tis_clipfrac"] == 0.0 and abs(same["train/ois"] - 1.0) < 1e-6
    # Sequence means of the rollout's log-probs, masked, over sequences.
    engine_ppl = sum(
        -sum(lp * m for lp, m in zip(lps, mask)) / sum(mask) for lps, mask in zip(logps, masks)
    )
    assert abs(same["train/mis_rollout_log_ppl"] - engine_ppl / n) < 1e-6
    assert abs(same["train/mis_training_log_ppl"] - engine_ppl / n) < 1e-4

    gap = step(LossConfig(get_mismatch_metrics=True, tis_clip_low=0.5), moved)
    assert abs(gap["train/train_rollout_logprob_abs_diff"] - sum(map(abs, d)) / n) < 1e-4
    assert abs(gap["train/mis_kl"] - sum(d) / n) < 1e-4  # rollout - trainer
    k3 = sum(math.exp(-x) + x - 1 for x in d) / n
    assert abs(gap["train/mis_k3_kl"] - k3) < 1e-4
    # exp(-d) leaves [0.5, 2] for d = 1, -1 and 2, on all of those sequences' scored tokens.
    assert gap["train/tis_clipfrac"] == pytest.approx(3 / n, abs=1e-6)  # float32 sums
    assert abs(gap["train/ppo_kl"]) < 1e-6  # the ratio's reference is still the trainer's

    calls = []
    bypass = step(LossConfig(use_rollout_logprobs=True), moved, count=calls)
    assert calls == []  # no old log-prob forward
    # ppo_kl = mean(old - logp) = mean(rollout - trainer) = mean d: the rollout is the reference.
    assert abs(bypass["train/ppo_kl"] - sum(d) / n) < 1e-4
    assert abs(bypass["train/train_rollout_logprob_abs_diff"] - sum(map(abs, d)) / n) < 1e-4
    assert "train/mis_kl" not in bypass and "train/tis" not in bypass
    measured = step(
        LossConfig(use_rollout_logprobs=True, get_mismatch_metrics=True), moved, count=calls
    )
    assert calls == [1] and abs(measured["train/mis_kl"] - sum(d) / n) < 1e-4
    assert abs(measured["train/ppo_kl"] - bypass["train/ppo_kl"]) < 1e-9
    # --kl-coef's penalty is taken from the old policy's log-probs: the rollout's here (slime's).
    kls = []
    compute = losses.compute_advantages
    monkeypatch.setattr(
        losses, "compute_advantages", lambda *a, kl=None: (kls.append(kl), compute(*a, kl=kl))[1]
    )
    monkeypatch.setattr(actor, "ref", actor.gpt)  # the reference: the policy itself
    rpp = dict(advantage_estimator="reinforce_plus_plus_baseline", kl_coef=0.1)
    # (with the trainer's old log-probs computed too, for the mismatch metrics: not used here)
    step(LossConfig(use_rollout_logprobs=True, get_mismatch_metrics=True, **rpp), moved)
    _, mask, _ = pad_batch(TrainBatch(tokens, lengths, rewards, masks), actor.device)
    per_row = (kls[0] * mask).sum(-1) / mask.sum(-1)  # k1: rollout - reference = d
    assert torch.allclose(per_row, torch.tensor(d), atol=1e-4), per_row
    # A rollout without log-probs (a custom generate function that kept none) is refused.
    with pytest.raises(ValueError, match="--use-rollout-logprobs needs the rollout's log-probs"):
        step(LossConfig(use_rollout_logprobs=True), None)
    samples = [
        Sample(tokens=t, response_length=k, reward=0.0, loss_mask=[1] * k)
        for t, k in zip(tokens, lengths)
    ]
    assert to_train_batch([samples[:4], samples[4:]]).rollout_log_probs is None
