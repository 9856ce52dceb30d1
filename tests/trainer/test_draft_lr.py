"""--draft-lr: the MTP layers trained online get a learning rate of their own, the policy keeps
--lr, and a checkpoint taken with it resumes bit for bit."""

from __future__ import annotations

import pytest
import torch

from tiny.checkpoints import add_mimo_mtp

pytest.importorskip("megatron.core")


@pytest.fixture(scope="module")
def mimo(make_model):
    return add_mimo_mtp(make_model("qwen2", num_layers=2, seed=51), seed=52)


def one_step(model: str, draft_lr: float | None) -> tuple[dict, dict]:
    """Weights before and after one train step."""
    from trainer_bridge.actor import TrainActor
    from trainer_bridge.batch import TrainBatch
    from trainer_bridge.megatron_compat import destroy_model_parallel
    from trainer_bridge.options import TrainerArgs

    args = TrainerArgs(hf_checkpoint=model, lr=1e-3, enable_mtp_training=True, draft_lr=draft_lr)
    actor = TrainActor(args)
    try:
        before = {n: p.detach().clone() for n, p in actor.gpt.named_parameters()}
        tokens = [[5, 6, 7, 8, 9, 10 + i, 11, 12] for i in range(4)]
        actor.train(TrainBatch(tokens, [5] * 4, [1.0, 0.0, 1.0, 0.0], n_samples_per_prompt=4))
        return before, {n: p.detach().clone() for n, p in actor.gpt.named_parameters()}
    finally:
        destroy_model_parallel()


def moved(before: dict, after: dict, mtp: bool) -> dict[str, float]:
    return {
        n: (after[n] - before[n]).abs().max().item()
        for n in before
        if n.startswith("mtp.") == mtp and not torch.equal(before[n], after[n])
    }


def test_draft_lr_is_the_mtp_layers_own_rate(mimo):
    base_before, base_after = one_step(mimo, None)
    assert moved(base_before, base_after, mtp=True) and moved(base_before, base_after, mtp=False)

    frozen_before, frozen_after = one_step(mimo, 0.0)
    assert moved(frozen_before, frozen_after, mtp=True) == {}
    trunk = [n for n in base_after if not n.startswith("mtp.")]
    assert all(torch.equal(frozen_after[n], base_after[n]) for n in trunk)

    fast_before, fast_after = one_step(mimo, 1e-2)
    fast, base = moved(fast_before, fast_after, True), moved(base_before, base_after, True)
    # Adam's first step moves each weight by about lr: ten times as far.
    assert 5 < max(fast.values()) / max(base.values()) < 20


def test_draft_lr_needs_a_draft_trained_online():
    from trainer_bridge.options import TrainerArgs

    with pytest.raises(ValueError, match="add --enable-mtp-training"):
        TrainerArgs(hf_checkpoint="m", draft_lr=1e-3)
    with pytest.raises(ValueError, match="--draft-lr must be >= 0"):
        TrainerArgs(hf_checkpoint="m", draft_lr=-1.0, enable_mtp_training=True)
    with pytest.raises(ValueError, match="--draft-lr with --bf16 is not implemented"):
        TrainerArgs(hf_checkpoint="m", draft_lr=1e-3, enable_mtp_training=True, bf16=True)


def test_a_checkpoint_with_draft_lr_resumes_bitwise(mimo, tmp_path):
    from trainer_bridge.actor import TrainActor
    from trainer_bridge.batch import TrainBatch
    from trainer_bridge.megatron_compat import destroy_model_parallel
    from trainer_bridge.options import TrainerArgs

    args = TrainerArgs(hf_checkpoint=mimo, lr=1e-3, enable_mtp_training=True, draft_lr=1e-2)
    tokens = [[5, 6, 7, 8, 9, 10 + i, 11, 12] for i in range(4)]
    batch = TrainBatch(tokens, [5] * 4, [1.0, 0.0, 1.0, 0.0], n_samples_per_prompt=4)
    directory = tmp_path / "iter_0000000"
    directory.mkdir()
    results = []
    for resumed in (False, True):
        actor = TrainActor(args)
        if resumed:
            actor.load_checkpoint(str(directory))
        else:
            actor.train(batch)
            actor.save_checkpoint(str(directory), 0)
        metrics = {k: v for k, v in actor.train(batch).items() if "perf/" not in k}
        results.append((metrics, {n: p.detach().clone() for n, p in actor.gpt.named_parameters()}))
        destroy_model_parallel()
    (metrics, weights), (resumed_metrics, resumed_weights) = results
    assert resumed_metrics == metrics
    assert all(torch.equal(weights[n], resumed_weights[n]) for n in weights)
