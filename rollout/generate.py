"""Generating samples: one response per Sample through a routed engine, then the group's rewards."""

from __future__ import annotations

import asyncio
import time
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
    """Append one engine output dict (return_logprob=True) to a sample whose `tokens` hold the
    prompt and the response so far (none, or a partial one that --partial-rollout continues):
    tokens, text, log-probs, loss mask and weight versions are extended, the speculative
    counters summed, the status set from the finish reason."""
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
    previous, new = sample.response_length, len(response_ids)
    if previous and len(sample.rollout_log_probs or ()) != previous:
        raise ValueError(
            f"sample {sample.index} continues a response of {previous} tokens that has no "
            "rollout_log_probs for each; a custom generate function must record them to be "
            "continued by --partial-rollout"
        )
    version = meta["weight_version"]
    sample.tokens = sample.tokens + response_ids
    sample.response = sample.response + output["text"]
    sample.response_length = previous + new
    sample.loss_mask = (sample.loss_mask or [1] * previous) + [1] * new
    sample.rollout_log_probs = (sample.rollout_log_probs or []) + log_probs
    sample.status = Status.from_finish_reason(meta["finish_reason"])
    if new or sample.status is not Status.ABORTED:  # an abort before any token added nothing
        sample.weight_versions = sample.weight_versions + [version]
    known = previous == 0 or sample.token_weight_versions is not None
    sample.token_weight_versions = (
        (sample.token_weight_versions or []) + [version] * new if known else None
    )
    if "spec_verify_ct" in meta:
        sample.spec_info = _add_spec_info(sample.spec_info, meta)
    return sample


def _add_spec_info(info: Optional[dict[str, float]], meta: dict[str, Any]) -> dict[str, float]:
    """The speculative counters of the sample's requests so far and this one's, summed (a
    continued sample made several requests); the accept length recomputed from the sums."""
    counters = ("spec_verify_ct", "spec_accept_token_num", "spec_draft_token_num")
    total = {key: (info or {}).get(key, 0) + meta[key] for key in counters}
    verify = total["spec_verify_ct"]
    # SGLang's count: tokens per verify pass, accepted drafts plus the bonus token.
    total["spec_accept_length"] = (
        (total["spec_accept_token_num"] + verify) / verify if verify else 0.0
    )
    # 1.0: the engine's acceptance alarm was up for the weights that generated any of it.
    alarm = float(meta.get("spec_accept_alarm", False))
    total["spec_accept_alarm"] = max(alarm, (info or {}).get("spec_accept_alarm", 0.0))
    return total


async def generate(
    args: Any, sample: Sample, sampling_params: dict[str, Any], engine: Any
) -> Sample:
    """The default generate function: one request for the sample's tokens, the prompt and any
    partial response (--partial-rollout continues it, as slime's generate, with max_new_tokens
    less the tokens it has)."""
    replay = getattr(args, "use_rollout_routing_replay", False)
    if replay and sample.response_length:
        raise ValueError(
            "--use-rollout-routing-replay records the routing of a response generated in one "
            "request; it cannot continue a partial one: drop --partial-rollout"
        )
    limit = sampling_params.get("max_new_tokens")  # absent: the engine's default
    if sample.response_length and limit is not None:
        if limit <= sample.response_length:  # continued with the most tokens it may have
            sample.status = Status.TRUNCATED
            return sample
        sampling_params = {**sampling_params, "max_new_tokens": limit - sample.response_length}
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

    A group kept by --partial-rollout comes back with its samples as they were: finished ones
    stay as they are, aborted ones are continued; with --mask-offpolicy-in-partial-rollout
    every token they already have is masked from the loss first (slime's generate_and_rm).
    """
    mask_offpolicy = args.partial_rollout and args.mask_offpolicy_in_partial_rollout

    async def one(sample: Sample) -> Sample:
        if mask_offpolicy and sample.response_length:
            # generated by the weights of an earlier rollout: off-policy for the ones trained
            sample.loss_mask = [0] * sample.response_length
        if sample.status in (Status.COMPLETED, Status.TRUNCATED):
            return sample  # finished in an earlier rollout, its group did not
        if stopping():
            sample.status = Status.ABORTED
            return sample
        sample.status = Status.PENDING  # an aborted sample is continued
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
        if result.status in (Status.COMPLETED, Status.TRUNCATED):
            result.finish_time = time.monotonic()
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
    unscored = [s for s in samples if s.reward is None]  # scored: finished earlier
    rewards = await asyncio.gather(*(score(reward_fn, fn_args or args, s) for s in unscored))
    for sample, reward in zip(unscored, rewards):
        sample.reward = reward
    return samples


def group_is_complete(group: list[Sample]) -> bool:
    """Every sample finished (COMPLETED or TRUNCATED) and was scored."""
    return all(
        s.status in (Status.COMPLETED, Status.TRUNCATED) and s.reward is not None for s in group
    )
