"""Dynamic sampling filters: `def f(args, samples: list[Sample]) -> bool`, False drops the group.

Selected with --dynamic-sampling-filter-path; the rollout over-samples prompts
(--over-sampling-batch-size) until --rollout-batch-size groups pass.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional

from rollout.loader import load_function
from rollout.sample import Sample

GroupFilter = Callable[[Any, list[Sample]], bool]


def check_reward_nonzero_std(args: Any, samples: list[Sample]) -> bool:
    """Keep a group only if its rewards differ: all-equal rewards give GRPO zero advantages."""
    rewards = [s.reward for s in samples]
    if any(r is None for r in rewards):
        raise ValueError(
            f"group {samples[0].group_index} has samples without a reward; the filter runs on "
            "scored groups"
        )
    return max(rewards) > min(rewards)


def load_filter(args: Any) -> Optional[GroupFilter]:
    """The filter named by --dynamic-sampling-filter-path, or None."""
    if args.dynamic_sampling_filter_path is None:
        return None
    return load_function(args.dynamic_sampling_filter_path, "--dynamic-sampling-filter-path")
