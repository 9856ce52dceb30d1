"""Reward functions: built-ins by --rm-type name, or a user function by --custom-rm-path.

A reward function is `[async] def rm(args, sample) -> float`, called once per finished sample
(not for ABORTED ones) with the RolloutArgs and the filled Sample.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable
from typing import Any

from rollout.loader import call_maybe_async, load_function

REWARD_TYPES = ("exact_match", "boxed_math", "tiny")

RewardFn = Callable[[Any, Any], Any]


def load_reward_fn(args: Any) -> RewardFn:
    """The reward function for `args.custom_rm_path`, else for the built-in `args.rm_type`."""
    if args.custom_rm_path is not None:
        return load_function(args.custom_rm_path, "--custom-rm-path")
    if args.rm_type is None:
        raise ValueError(
            "no reward function: set --rm-type (one of "
            f"{', '.join(REWARD_TYPES)}) or --custom-rm-path my_pkg.my_module:my_rm"
        )
    if args.rm_type == "exact_match":
        from rollout.rewards.exact_match import exact_match_rm

        return exact_match_rm
    if args.rm_type == "boxed_math":
        from rollout.rewards.boxed_math import boxed_math_rm

        return boxed_math_rm
    if args.rm_type == "tiny":
        from rollout.rewards.tiny import tiny_rm

        return tiny_rm
    raise ValueError(f"--rm-type must be one of {', '.join(REWARD_TYPES)}, got {args.rm_type!r}")


async def score(reward_fn: RewardFn, args: Any, sample: Any) -> float:
    """Run a (sync or async) reward function and check it returned a number."""
    reward = await call_maybe_async(reward_fn, args, sample)
    if isinstance(reward, bool) or not isinstance(reward, numbers.Real):
        name = getattr(reward_fn, "__qualname__", repr(reward_fn))
        raise TypeError(
            f"reward function {name} returned {reward!r} for sample {sample.index}; it must return "
            "a float"
        )
    return float(reward)
