"""RolloutManager: one rollout = groups of samples from the engines, filtered, scored, measured."""

from __future__ import annotations

import argparse
import asyncio
import copy
import dataclasses
import logging
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any, Optional

from rollout.config import RolloutArgs
from rollout.data_source import DataSource
from rollout.engine_load import POLL_INTERVAL_S, BatchSizeTrace
from rollout.filters import load_filter
from rollout.generate import generate, generate_group, group_is_complete, sampling_params_from_args
from rollout.loader import call_maybe_async, load_function, run_sync
from rollout.metrics import rollout_metrics, sample_metrics
from rollout.rewards import load_reward_fn
from rollout.router import Router
from rollout.sample import Sample

logger = logging.getLogger(__name__)

Groups = list[list[Sample]]
STATS = (
    "groups_submitted",
    "groups_filtered",
    "groups_aborted",
    "groups_leftover",
    "response_tokens",
)


@dataclasses.dataclass
class _Fill:
    """One rollout's groups in flight, the ones kept, and the tallies of what became of them."""

    rid_prefix: str
    kept: Groups = dataclasses.field(default_factory=list)
    leftover: Groups = dataclasses.field(default_factory=list)  # finished or aborted, not needed
    pending: set[asyncio.Task] = dataclasses.field(default_factory=set)
    stopping: bool = False  # read by the groups in flight: stop sampling more
    stats: dict[str, int] = dataclasses.field(default_factory=lambda: dict.fromkeys(STATS, 0))


class RolloutManager:
    """Generates rollouts over engine handles (in-process `spec_engine.Engine`s or
    `RayEngineHandle`s) from the prompt data in `args`.

    `generate(rollout_id)` submits groups of --over-sampling-batch-size prompts concurrently,
    keeps groups that finished and pass --dynamic-sampling-filter-path until
    --rollout-batch-size are kept, then aborts the groups still in flight and waits for them.
    With --partial-rollout the groups left over go back to the data source's buffer, partial
    responses and all, and the next rollout takes them first and continues them.
    """

    def __init__(
        self,
        args: RolloutArgs,
        engines: Sequence[Any],
        tokenizer: Any,
        data_source: Optional[DataSource] = None,
        launcher_args: Optional[argparse.Namespace] = None,
    ) -> None:
        self.args = args
        # What user functions (generate, reward, filter, rollout) receive: as in slime, every
        # launcher flag (--hf-checkpoint, --sglang-*, ...), with the rollout options as checked.
        self.fn_args = user_args(args, launcher_args)
        self.tokenizer = tokenizer
        self.router = Router(engines) if engines else None
        if data_source is None and args.prompt_data is not None:
            data_source = DataSource.from_args(args, tokenizer)
        self.data_source = data_source
        self.reward_fn = load_reward_fn(args) if args.rm_type or args.custom_rm_path else None
        self.filter_fn = load_filter(args)
        self.generate_fn = (
            load_function(args.custom_generate_function_path, "--custom-generate-function-path")
            if args.custom_generate_function_path
            else generate
        )
        self.rollout_fn = (
            load_function(args.rollout_function_path, "--rollout-function-path")
            if args.rollout_function_path
            else None
        )
        self.next_group_index = 0
        # Called with (groups kept, groups wanted) whenever a group is kept: a progress bar's hook.
        self.on_group_kept: Optional[Callable[[int, int], None]] = None
        self.next_sample_index = 0
        self._eval_sources: dict[str, DataSource] = {}
        # The engines' running requests over the last rollout (the built-in one), polled every
        # batch_size_poll_interval seconds while it filled its batch.
        self.batch_size_trace = BatchSizeTrace()
        self.batch_size_poll_interval = POLL_INTERVAL_S

    # ------------------------------------------------------------ rollouts

    def generate(self, rollout_id: int) -> tuple[Groups, dict[str, float]]:
        """One rollout: (groups of n_samples_per_prompt samples, metrics). Sync form of
        agenerate."""
        return run_sync(self.agenerate(rollout_id))

    async def agenerate(self, rollout_id: int) -> tuple[Groups, dict[str, float]]:
        """Metrics: docs/design.md's rollout/* and perf/* keys (rollout.metrics.rollout_metrics),
        and for the built-in rollout rollout/groups_{submitted,filtered,aborted,leftover}: groups
        sent, dropped by the filter, dropped for an aborted or failed sample, and not needed
        (aborted leftovers and groups that finished after the batch was full: dropped, or with
        --partial-rollout kept for the next rollout); with --partial-rollout also
        rollout/partial_samples_ratio, the share of the rollout's samples begun in an earlier
        one; perf/engine_batch_size/{mean,max} (rollout.engine_load.BatchSizeTrace)."""
        start = time.perf_counter()
        self.batch_size_trace = BatchSizeTrace()
        if self.rollout_fn is not None:
            groups = await call_maybe_async(self.rollout_fn, self.fn_args, rollout_id, self)
            _check_groups(groups, "--rollout-function-path")
            return groups, rollout_metrics(groups, time.perf_counter() - start)
        groups, stats = await self._generate_filtered(rollout_id)
        metrics = rollout_metrics(groups, time.perf_counter() - start, stats.pop("response_tokens"))
        metrics.update({f"rollout/{k}": float(v) for k, v in stats.items()})
        metrics.update(self.batch_size_trace.metrics())
        if self.args.partial_rollout:
            samples = [s for g in groups for s in g]
            begun_earlier = sum("start_rollout_id" in s.metadata for s in samples)
            metrics["rollout/partial_samples_ratio"] = begun_earlier / len(samples)
        return groups, metrics

    async def _generate_filtered(self, rollout_id: int) -> tuple[Groups, dict[str, int]]:
        args = self.args
        router, data_source = self._require_engines(), self._require_data()
        if self.reward_fn is None:
            raise ValueError("no reward function: set --rm-type or --custom-rm-path")
        # aborting leftovers touches this rollout's requests only
        fill = _Fill(rid_prefix=f"rollout-{uuid.uuid4().hex[:8]}-")
        params = sampling_params_from_args(args)
        trace = self.batch_size_trace
        poller = asyncio.ensure_future(
            trace.poll(lambda: router.engines, self.batch_size_poll_interval)
        )
        try:
            while len(fill.kept) < args.rollout_batch_size:
                self._top_up(fill, params, router, data_source)
                done, fill.pending = await asyncio.wait(
                    fill.pending, return_when=asyncio.FIRST_COMPLETED
                )
                self._sort_finished(fill, done)
        except BaseException:
            fill.stopping = True
            await trace.stop(poller)
            # the first error is the one to report
            await self._abort(fill.pending, fill.rid_prefix, raise_errors=False)
            raise
        fill.stopping = True
        await trace.stop(poller)  # the batch is full: what runs now is aborted
        leftovers = await self._abort(fill.pending, fill.rid_prefix, raise_errors=True)
        fill.stats["response_tokens"] += sum(s.response_length for g in leftovers for s in g)
        fill.leftover = sorted(fill.leftover + leftovers, key=lambda g: g[0].group_index)
        fill.stats["groups_leftover"] = len(fill.leftover)
        if args.partial_rollout:
            self._keep_partial(fill.leftover, rollout_id, data_source)
        return fill.kept, fill.stats

    def _keep_partial(self, groups: Groups, rollout_id: int, data_source: DataSource) -> None:
        """--partial-rollout: the groups left over go back to the data source, to be continued
        (slime's abort(): a sample with a response is marked with the rollout it began in)."""
        for sample in (s for g in groups for s in g):
            if sample.response_length and "start_rollout_id" not in sample.metadata:
                sample.metadata["start_rollout_id"] = rollout_id
            sample.finish_time = None  # finished in this rollout, not in the one that trains it
        data_source.add_samples(groups)
        if groups:
            logger.info("kept %d partial groups for the next rollout", len(groups))

    def _top_up(self, fill: _Fill, params: dict, router: Router, data_source: DataSource) -> None:
        """Keep enough groups in flight to fill the batch if every one of them is kept."""
        args, stats = self.args, fill.stats
        while len(fill.kept) + len(fill.pending) < args.rollout_batch_size:
            if stats["groups_submitted"] >= args.max_groups:
                raise RuntimeError(
                    f"submitted {stats['groups_submitted']} groups but kept only "
                    f"{len(fill.kept)} of "
                    f"{args.rollout_batch_size} ({stats['groups_filtered']} filtered out, "
                    f"{stats['groups_aborted']} aborted or failed); raise "
                    "--dynamic-sampling-max-groups "
                    "or loosen --dynamic-sampling-filter-path"
                )
            groups = []
            if args.partial_rollout:  # groups left over by the last rollout first
                groups = data_source.get_samples_from_buffer(args.over_sampling_size)
                # their tokens were counted when they were generated
                stats["response_tokens"] -= sum(s.response_length for g in groups for s in g)
            prompts = data_source.get_prompts(args.over_sampling_size - len(groups))
            for group in groups + self._new_groups(prompts, args.n_samples_per_prompt):
                task = generate_group(
                    args,
                    group,
                    params,
                    router,
                    self.generate_fn,
                    self.reward_fn,
                    lambda: fill.stopping,
                    fill.rid_prefix,
                    self.fn_args,
                )
                fill.pending.add(asyncio.ensure_future(task))
                stats["groups_submitted"] += 1

    def _sort_finished(self, fill: _Fill, done: set[asyncio.Task]) -> None:
        """Finished groups, in prompt order: kept, filtered out, aborted, or left over."""
        stats, wanted = fill.stats, self.args.rollout_batch_size
        for group in sorted((t.result() for t in done), key=lambda g: g[0].group_index):
            stats["response_tokens"] += sum(s.response_length for s in group)
            if not group_is_complete(group):
                stats["groups_aborted"] += 1
            elif self.filter_fn is not None and not self.filter_fn(self.fn_args, group):
                stats["groups_filtered"] += 1
            elif len(fill.kept) < wanted:
                fill.kept.append(group)
                if self.on_group_kept is not None:
                    self.on_group_kept(len(fill.kept), wanted)
            else:  # finished together with the last group needed
                fill.leftover.append(group)

    async def _abort(
        self, pending: set[asyncio.Task], rid_prefix: str, raise_errors: bool
    ) -> Groups:
        """Abort the requests of unfinished groups and wait for them to end; returns their
        groups."""
        aborted = await self._require_engines().abort_all(rid_prefix)
        if pending or aborted:
            logger.info(
                "aborting %d leftover groups (%d requests in flight)", len(pending), aborted
            )
        results = await asyncio.gather(*pending, return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        # Once each: every group of an engine that died (and was not restarted) has its error.
        for error in {(type(e), str(e)): e for e in errors}.values():
            logger.error("a leftover group failed while being aborted", exc_info=error)
        if errors and raise_errors:
            raise errors[0]
        return [r for r in results if not isinstance(r, BaseException)]

    def _new_groups(self, prompts: list[Sample], n: int) -> Groups:
        groups = []
        for prompt in prompts:
            group = []
            for _ in range(n):
                group.append(
                    Sample(
                        group_index=self.next_group_index,
                        index=self.next_sample_index,
                        prompt=prompt.prompt,
                        tokens=list(prompt.tokens),
                        label=prompt.label,
                        metadata=copy.deepcopy(prompt.metadata),
                    )
                )
                self.next_sample_index += 1
            groups.append(group)
            self.next_group_index += 1
        return groups

    # ------------------------------------------------------------ evaluation

    def eval(self, rollout_id: int) -> tuple[dict[str, Groups], dict[str, float]]:
        """Every prompt of each --eval-prompt-data set, n_samples_per_eval_prompt times, with the
        --eval-* sampling overrides; metrics eval/{name} (mean reward) and eval/{name}/*."""
        return run_sync(self.aeval(rollout_id))

    async def aeval(self, rollout_id: int) -> tuple[dict[str, Groups], dict[str, float]]:
        args = self.args
        if not args.eval_datasets:
            raise ValueError("no evaluation data: set --eval-prompt-data NAME PATH [NAME PATH ...]")
        if self.reward_fn is None:
            raise ValueError("no reward function: set --rm-type or --custom-rm-path")
        router = self._require_engines()
        params = sampling_params_from_args(args, evaluation=True)
        results: dict[str, Groups] = {}
        metrics: dict[str, float] = {}
        for name, path in args.eval_datasets:
            if name not in self._eval_sources:
                self._eval_sources[name] = DataSource.from_args(
                    args, self.tokenizer, path=path, shuffle=False
                )
            # Indices (and so sampling seeds) restart for every evaluation: each one draws the same
            # randomness.
            groups = [
                [
                    Sample(
                        group_index=g,
                        index=g * args.n_samples_per_eval_prompt + i,
                        prompt=p.prompt,
                        tokens=list(p.tokens),
                        label=p.label,
                        metadata=copy.deepcopy(p.metadata),
                    )
                    for i in range(args.n_samples_per_eval_prompt)
                ]
                for g, p in enumerate(self._eval_sources[name].all_prompts())
            ]
            groups = list(
                await asyncio.gather(
                    *(
                        generate_group(
                            args,
                            group,
                            params,
                            router,
                            self.generate_fn,
                            self.reward_fn,
                            fn_args=self.fn_args,
                        )
                        for group in groups
                    )
                )
            )
            results[name] = groups
            samples = [s for group in groups for s in group]
            stats = sample_metrics(samples, f"eval/{name}")
            reward = stats.pop(
                f"eval/{name}/raw_reward", None
            )  # absent when every group was aborted
            if reward is not None:
                metrics[f"eval/{name}"] = reward
            metrics.update(stats)
        return results, metrics

    # ------------------------------------------------------------ state

    def state_dict(self) -> dict[str, Any]:
        """What a resumed run needs to continue the prompt order and sample numbering."""
        return {
            "next_group_index": self.next_group_index,
            "next_sample_index": self.next_sample_index,
            "data_source": self.data_source.state_dict() if self.data_source is not None else None,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.next_group_index = state["next_group_index"]
        self.next_sample_index = state["next_sample_index"]
        if state["data_source"] is not None:
            self._require_data().load_state_dict(state["data_source"])

    def _require_engines(self) -> Router:
        if self.router is None:
            raise ValueError("this RolloutManager has no engines; pass engine handles to generate")
        return self.router

    def _require_data(self) -> DataSource:
        if self.data_source is None:
            raise ValueError(
                "no prompt data: set --prompt-data (or --rollout-function-path to roll out without "
                "it)"
            )
        return self.data_source


def _check_groups(groups: Any, flag: str) -> None:
    if not isinstance(groups, list) or not all(
        isinstance(g, list) and all(isinstance(s, Sample) for s in g) for g in groups
    ):
        raise TypeError(
            f"the function of {flag} must return list[list[Sample]], got {type(groups).__name__}"
        )


def user_args(args: RolloutArgs, launcher_args: Optional[argparse.Namespace]) -> Any:
    """The launcher's whole namespace with the checked rollout options over it (slime hands its
    full args to custom functions); just `args` without a launcher."""
    if launcher_args is None:
        return args
    merged = argparse.Namespace(**vars(launcher_args))
    for f in dataclasses.fields(args):
        setattr(merged, f.name, getattr(args, f.name))
    return merged
