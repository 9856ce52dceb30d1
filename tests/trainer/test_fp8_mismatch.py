"""FP8 rollouts with float32 training at the actor level: rollouts of an engine serving the
policy's weights in block FP8 (--quantization fp8) carry a train–rollout mismatch that
--get-mismatch-metrics measures (mean |trainer - rollout| log-prob, k3 KL) far above the
unquantized engine's (which is the trainer's numerics, up to kernels), and --use-tis weights it.
The full RL run's figures are in docs/benchmarks/fp8_rollouts_cpu.md."""

from __future__ import annotations

import pytest

from tests.trainer.test_actor import rollout
from tiny.checkpoints import add_mimo_mtp
from trainer_bridge.loss import LossConfig

pytest.importorskip("megatron.core")

MTP = dict(speculative_algorithm="EAGLE", speculative_num_steps=2, speculative_eagle_topk=1)


@pytest.fixture(scope="module")
def mimo(make_model):
    return add_mimo_mtp(make_model("qwen2", num_layers=2, seed=71), seed=72)


@pytest.fixture(scope="module")
def actor(mimo):
    from trainer_bridge.actor import TrainActor
    from trainer_bridge.megatron_compat import destroy_model_parallel
    from trainer_bridge.options import TrainerArgs

    cfg = LossConfig(use_tis=True, get_mismatch_metrics=True)
    a = TrainActor(TrainerArgs(hf_checkpoint=mimo, micro_batch_size=8), cfg, temperature=1.0)
    a.optimizer.step = lambda: (True, 0.0, None)  # measure only: the weights stay
    yield a
    destroy_model_parallel()


def _mismatch(actor, path: str, **engine_kwargs) -> dict[str, float]:
    from trainer_bridge.batch import TrainBatch

    tokens, lengths, logps = rollout(path, **engine_kwargs)
    rewards = [float(i % 2) for i in range(len(tokens))]
    try:
        return actor.train(
            TrainBatch(tokens, lengths, rewards, None, logps, n_samples_per_prompt=4)
        )
    finally:
        actor.model.zero_grad_buffer()


def test_fp8_rollouts_bring_a_measured_mismatch(actor, mimo):
    plain = _mismatch(actor, mimo, **MTP)
    fp8 = _mismatch(actor, mimo, quantization="fp8", **MTP)
    assert plain["train/train_rollout_logprob_abs_diff"] < 1e-4
    assert fp8["train/train_rollout_logprob_abs_diff"] > 100 * max(
        plain["train/train_rollout_logprob_abs_diff"], 1e-6
    )
    assert fp8["train/mis_k3_kl"] > 100 * max(plain["train/mis_k3_kl"], 1e-9)
    assert abs(fp8["train/tis"] - 1.0) > abs(plain["train/tis"] - 1.0)
