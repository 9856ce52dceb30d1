"""Generating samples: one response per Sample through a routed engine, then the group's rewards."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable
from typing import Any, Optional

from rollout.rewards import RewardFn, score
from rollout.router import RequestAborted, Router
from rollout.sample import Sample, Status

GenerateFn = Callable[[Any, Sample, dict[str, Any], Any], Awaitable[Sample]]


def sampling_params_from_args(args: Any, evaluation: bool = False) -> dict[str, Any]:
    """SGLang sampling params for a rollout (or, with `evaluation`, for --eval-* overrides)."""
    params: dict[str, Any] = {
        "max_new_tokens": args.rollout_max_response_len,
        "temperature": args.rollout_temperature,
        "top_p": args.rollout_top_p,
        "top_k": args.rollout_top_k,
        "skip_special_tokens": args.rollout_skip_special_tokens,
    }
    if evaluation:
        for key, value in (
            ("max_new_tokens", args.eval_max_response_len),
            ("temperature", args.eval_temperature),
            ("top_p", args.eval_top_p),
        ):
            if value is not None:
                params[key] = value
    if args.rollout_stop:
        params["stop"] = list(args.rollout_stop)
    if args.rollout_stop_token_ids:
        params["stop_token_ids"] = list(args.rollout_stop_token_ids)
    return params


def sample_seed(rollout_seed: int, index: int) -> int:
    """A per-sample sampling_seed, so a sample's randomness does not depend on batching order."""
    return (rollout_seed * 2**32 + index) % 2**63


def fill_from_output(sample: Sample, output: dict[str, Any]) -> Sample:
    """Fill a sample whose `tokens` hold the prompt from one engine output dict
    (return_logprob=True)."""
    meta = output["meta_info"]
    response_ids = list(output["output_ids"])
    if output.get("text") is None:
        raise ValueError(
            f"the engine returned no text for request {meta.get('id')}; rewards need it, so start "
            "the "
            "engine with a tokenizer (not skip_tokenizer_init)"
        )
    if "output_token_logprobs" not in meta:
        raise ValueError(
            "the engine output has no output_token_logprobs; call async_generate with "
            "return_logprob=True"
        )
    log_probs = [float(lp) for lp, _, _ in meta["output_token_logprobs"]]
    if len(log_probs) != len(response_ids):
        raise ValueError(
            f"request {meta.get('id')}: {len(log_probs)} log-probs for {len(response_ids)} output "
            "tokens"
        )
    sample.tokens = sample.tokens + response_ids
    sample.response = output["text"]
    sample.response_length = len(response_ids)
    sample.loss_mask = [1] * len(response_ids)
    sample.rollout_log_probs = log_probs
    sample.status = Status.from_finish_reason(meta["finish_reason"])
    sample.weight_versions = sample.weight_versions + [meta["weight_version"]]
    if "spec_verify_ct" in meta:
        sample.spec_info = {
            key: meta[key]
            for key in (
                "spec_verify_ct",
                "spec_accept_length",
                "spec_accept_token_num",
                "spec_draft_token_num",
            )
        }
        # 1.0: the engine's acceptance alarm was up for the weights that generated it.
        sample.spec_info["spec_accept_alarm"] = float(meta.get("spec_accept_alarm", False))
    return sample


async def generate(
    args: Any, sample: Sample, sampling_params: dict[str, Any], engine: Any
) -> Sample:
    """The default generate function: one request for the sample's prompt tokens."""
    replay = getattr(args, "use_rollout_routing_replay", False)
    output = await engine.async_generate(
        input_ids=list(sample.tokens),
        sampling_params=sampling_params,
        return_logprob=True,
        **({"return_routed_experts": True} if replay else {}),
    )
    fill_from_output(sample, output)
    if replay:
        from trainer_bridge.routing_replay import decode_routed_experts

        sample.rollout_routed_experts = decode_routed_experts(
            output["meta_info"], args.hf_checkpoint
        )
    return sample


async def generate_group(
    args: Any,
    group: list[Sample],
    sampling_params: dict[str, Any],
    router: Router,
    generate_fn: GenerateFn,
    reward_fn: Optional[RewardFn],
    stopping: Callable[[], bool] = lambda: False,
    rid_prefix: str = "",
    fn_args: Any = None,
) -> list[Sample]:
    """Generate every sample of a group concurrently, then score them (with a reward_fn, and
    only when none was aborted or failed). `fn_args` is what generate_fn and reward_fn receive
    (default `args`).

    Samples that have not started when `stopping()` turns true end ABORTED without a request;
    request ids start with `rid_prefix` (see Router.abort_all).
    """

    async def one(sample: Sample) -> Sample:
        if stopping():
            sample.status = Status.ABORTED
            return sample
        params = {**sampling_params, "sampling_seed": sample_seed(args.rollout_seed, sample.index)}
        with router.lease(rid_prefix + uuid.uuid4().hex) as engine:
            try:
                result = await generate_fn(fn_args or args, sample, params, engine)
            except RequestAborted:
                sample.status = Status.ABORTED
                return sample
        if not isinstance(result, Sample) or result.status is Status.PENDING:
            raise ValueError(
                f"the generate function {getattr(generate_fn, '__qualname__', generate_fn)} "
                "returned "
                f"{result!r:.200}; it must return the Sample with its status set from the finish "
                "reason"
            )
        return result

    tasks = [asyncio.ensure_future(one(s)) for s in group]
    try:
        samples = list(await asyncio.gather(*tasks))
    except BaseException:
        # One sample failed: stop its siblings (their leases abort their requests) before reporting
        # it.
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
    if reward_fn is None or any(s.status in (Status.ABORTED, Status.FAILED) for s in samples):
        return samples  # unscored: a group with an aborted or failed sample is dropped
    rewards = await asyncio.gather(*(score(reward_fn, fn_args or args, s) for s in samples))
    for sample, reward in zip(samples, rewards):
        sample.reward = reward
    return samples


def group_is_complete(group: list[Sample]) -> bool:
    """Every sample finished (COMPLETED or TRUNCATED) and was scored."""
    return all(
        s.status in (Status.COMPLETED, Status.TRUNCATED) and s.reward is not None for s in group
    )
