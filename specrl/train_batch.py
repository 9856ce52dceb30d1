"""A rollout's groups of samples as the trainer's batch."""

from __future__ import annotations

from rollout.sample import Sample
from trainer_bridge.batch import TrainBatch


def to_train_batch(groups: list[list[Sample]]) -> TrainBatch:
    """The trainer's batch; the group size (GRPO's n) is read from the groups themselves."""
    sizes = {len(g) for g in groups}
    if len(sizes) != 1:
        raise ValueError(
            f"groups of different sizes {sorted(sizes)}; group-relative advantages need equal "
            "groups (each prompt sampled --n-samples-per-prompt times)"
        )
    samples = [s for g in groups for s in g]
    return TrainBatch(
        tokens=[list(s.tokens) for s in samples],
        response_lengths=[s.response_length for s in samples],
        rewards=[float(s.reward) for s in samples],
        loss_masks=[list(s.loss_mask) for s in samples],
        # None when a sample has none (a custom generate function may not record them): the
        # trainer then refuses the flags that need them (LossConfig.check_rollout_log_probs).
        rollout_log_probs=(
            [list(s.rollout_log_probs) for s in samples]
            if all(s.rollout_log_probs is not None for s in samples)
            else None
        ),
        n_samples_per_prompt=sizes.pop(),
        rollout_routed_experts=(
            [s.rollout_routed_experts for s in samples]
            if all(s.rollout_routed_experts is not None for s in samples)
            else None
        ),
    )
