"""--partial-rollout (slime's): groups left over when a rollout is full are kept with their
partial responses and continued in the next rollout; --mask-offpolicy-in-partial-rollout masks
the tokens of earlier rollouts. Real in-process engines on the tiny random checkpoint."""

from __future__ import annotations

import asyncio
import copy
import json

import pytest
from transformers import AutoTokenizer

from rollout import RolloutArgs, RolloutManager, Sample, Status
from rollout.generate import fill_from_output, generate
from rollout.metrics import staleness_metrics
from rollout.tiny_task import write_tiny_task
from spec_engine import Engine
from tests.rollout.test_rollout import make_args

NUM_ROLLOUTS = 4


@pytest.fixture(scope="module")
def tokenizer(llama_path):
    return AutoTokenizer.from_pretrained(llama_path)


@pytest.fixture(scope="module")
def engine(llama_path):
    with Engine(model_path=llama_path, random_seed=0) as e:
        yield e


def partial_args(data: str, **kwargs) -> RolloutArgs:
    """Six groups in flight for two kept: four are left over every rollout. Stopping on a tenth
    of the vocabulary spreads the response lengths (the random model's EOS is rare), so groups
    finish at different steps and the abort catches the others half-way."""
    settings = dict(
        rollout_batch_size=2,
        n_samples_per_prompt=2,
        over_sampling_batch_size=6,
        rollout_max_response_len=32,
        rollout_stop_token_ids=list(range(100, 150)),
        partial_rollout=True,
    )
    return make_args(data, **{**settings, **kwargs})


def restored(manager: RolloutManager, args: RolloutArgs, engine, tokenizer) -> RolloutManager:
    """A fresh manager from `manager`'s state as a checkpoint holds it (JSON)."""
    state = json.loads(json.dumps(manager.state_dict()))
    again = RolloutManager(args, [engine], tokenizer)
    again.load_state_dict(state)
    return again


@pytest.mark.parametrize("mask", [True, False], ids=["masked", "unmasked"])
def test_partial_groups_are_continued_and_every_group_is_trained_once(
    mask, engine, tokenizer, tmp_path
):
    data = str(tmp_path / "task.jsonl")
    write_tiny_task(data, tokenizer, n=16)
    args = partial_args(data, mask_offpolicy_in_partial_rollout=mask)
    manager = RolloutManager(args, [engine], tokenizer)
    trained: list[int] = []  # group indices, in the order they were trained
    continued = 0  # samples continued from a partial response
    stale_max = 0  # the most stale token trained
    for rollout_id in range(NUM_ROLLOUTS):
        if rollout_id == 2:  # resumed from a checkpoint in the middle: the buffer goes along
            before = manager
            manager = restored(manager, args, engine, tokenizer)
            assert manager.data_source.buffer == before.data_source.buffer != []
            assert manager.next_sample_index == before.next_sample_index
        # The trainer's new weights: every rollout under a new version.
        version = str(rollout_id)
        engine.update_weight_version(version)
        carried = {s.index: copy.deepcopy(s) for g in manager.data_source.buffer for s in g}
        groups, metrics = manager.generate(rollout_id)
        samples = [s for g in groups for s in g]
        assert len(groups) == 2
        for g in groups:  # a group's own samples, none lost, none from another group
            assert [s.index for s in g] == [2 * g[0].group_index, 2 * g[0].group_index + 1]
        trained += [g[0].group_index for g in groups]
        for s in samples:
            assert s.status in (Status.COMPLETED, Status.TRUNCATED) and s.reward is not None
            assert s.response_length <= 32 and s.tokens[-s.response_length :] == s.response_tokens
            assert len(s.token_weight_versions) == len(s.rollout_log_probs) == s.response_length
            old = carried.get(s.index)
            if old is None or not old.response_length:
                assert "start_rollout_id" not in s.metadata
                assert s.token_weight_versions == [version] * s.response_length
                assert s.weight_versions == [version] and s.loss_mask == [1] * s.response_length
                continue
            # Continued, not restarted: its first part, then what this rollout added.
            n = old.response_length
            assert s.tokens[: len(old.tokens)] == old.tokens
            assert s.rollout_log_probs[:n] == old.rollout_log_probs
            assert s.response.startswith(old.response)
            assert s.token_weight_versions[:n] == old.token_weight_versions
            assert s.metadata["start_rollout_id"] < rollout_id
            assert version not in old.token_weight_versions
            added = s.response_length - n
            assert s.token_weight_versions[n:] == [version] * added
            if old.status is Status.ABORTED:  # one more request, under this rollout's weights
                # (listed if it added a token or finished: an abort before any adds nothing)
                adds = added > 0 or s.status is not Status.ABORTED
                assert s.weight_versions == old.weight_versions + [version] * adds
                continued += added > 0
            else:  # finished before, in a group that had not
                assert s.weight_versions == old.weight_versions and added == 0
            # slime's mask: only the tokens of the weights being trained count
            on_policy = [int(v == version) for v in s.token_weight_versions]
            assert s.loss_mask == (on_policy if mask else [1] * s.response_length)
        begun_earlier = sum("start_rollout_id" in s.metadata for s in samples)
        assert metrics["rollout/partial_samples_ratio"] == begun_earlier / len(samples)
        # Staleness, by hand: the rollout's weights less each trained token's. The oldest token
        # of a continued sample is from the rollout it began in.
        lags = [
            rollout_id - int(v)
            for s in samples
            for v, m in zip(s.token_weight_versions, s.loss_mask)
            if m == 1
        ]
        begun = [rollout_id - s.metadata.get("start_rollout_id", rollout_id) for s in samples]
        oldest = 0 if mask else max(begun)
        # None left when masking and both groups had finished in earlier rollouts: no metric.
        assert staleness_metrics(groups, rollout_id) == (
            {
                "rollout/weight_version_lag/mean": sum(lags) / len(lags),
                "rollout/weight_version_lag/max": float(oldest),
            }
            if lags
            else {}
        )
        stale_max = max(stale_max, oldest)
        assert metrics["rollout/groups_leftover"] == len(manager.data_source.buffer) == 4
        # perf/tokens_per_s counts each token in the rollout that generated it
        now = samples + [s for g in manager.data_source.buffer for s in g]
        generated = sum(s.response_length for s in now) - sum(
            s.response_length for s in carried.values()
        )
        tokens = metrics["perf/tokens_per_s"] * metrics["perf/rollout_time"]
        assert tokens == pytest.approx(generated)
    assert continued > 0, "no rollout continued a partial response; the test proves nothing"
    # --mask-offpolicy-in-partial-rollout trains no token of older weights
    assert (stale_max == 0) if mask else (stale_max > 0)
    # Nothing lost or duplicated: every group made is trained once or still waits in the buffer.
    waiting = [g[0].group_index for g in manager.data_source.buffer]
    assert len(trained) == len(set(trained)) == 2 * NUM_ROLLOUTS
    assert sorted(trained + waiting) == list(range(manager.next_group_index))
    for group in manager.data_source.buffer:  # partial responses kept with their tokens
        for s in group:
            assert len(s.rollout_log_probs or []) == s.response_length
            assert s.status is not Status.ABORTED or s.response_length < 32


def test_without_partial_rollout_leftovers_are_dropped(engine, tokenizer, tmp_path):
    data = str(tmp_path / "task.jsonl")
    write_tiny_task(data, tokenizer, n=16)
    manager = RolloutManager(partial_args(data, partial_rollout=False), [engine], tokenizer)
    manager.batch_size_poll_interval = 0.01
    groups, metrics = manager.generate(0)
    assert metrics["rollout/groups_leftover"] == 4 and manager.data_source.buffer == []
    # the real engine's running requests: at most the 6 groups of 2 in flight
    polled = manager.batch_size_trace.running
    assert polled and all(0 <= n <= 12 for [n] in polled) and max(polled)[0] > 0
    assert metrics["perf/engine_batch_size/max"] == max(polled)[0]
    assert "rollout/partial_samples_ratio" not in metrics
    groups, _ = manager.generate(1)
    assert min(g[0].group_index for g in groups) >= 6  # new prompts only


def output(ids: list[int], logprobs: list[float], text: str, finish: str, version: str) -> dict:
    """An engine output dict as SGLang returns it with return_logprob=True."""
    return {
        "text": text,
        "output_ids": ids,
        "meta_info": {
            "id": "r",
            "finish_reason": {"type": finish},
            "weight_version": version,
            "output_token_logprobs": [(lp, t, None) for lp, t in zip(logprobs, ids)],
            "spec_verify_ct": 2,
            "spec_accept_token_num": len(ids) - 2,
            "spec_draft_token_num": 4,
        },
    }


class InstantEngine:
    """Every request finishes at once: all groups of a rollout finish together, the ones not
    needed after the batch is full."""

    def __init__(self) -> None:
        self.requests = 0

    async def async_generate(self, input_ids, sampling_params, **kwargs):
        self.requests += 1
        return output([7, 8], [-0.5, -0.5], " bc", "stop", "v0")

    def abort_request(self, rid: str) -> None:
        pass


def counting_rm(args, sample):
    sample.metadata["scored"] = sample.metadata.get("scored", 0) + 1
    return 1.0


def test_groups_finished_after_the_batch_is_full_are_trained_next_without_a_request(
    tokenizer, tmp_path
):
    data = str(tmp_path / "task.jsonl")
    write_tiny_task(data, tokenizer, n=16)
    handle = InstantEngine()
    rm = "tests.rollout.test_partial_rollout:counting_rm"
    manager = RolloutManager(
        partial_args(data, rm_type=None, custom_rm_path=rm), [handle], tokenizer
    )
    groups, metrics = manager.generate(0)
    assert [g[0].group_index for g in groups] == [0, 1] and handle.requests == 12
    assert metrics["rollout/groups_leftover"] == 4
    assert [g[0].group_index for g in manager.data_source.buffer] == [2, 3, 4, 5]
    groups, metrics = manager.generate(1)
    # the two buffered groups first, finished and scored already; two new ones made with them
    assert [g[0].group_index for g in groups] == [2, 3] and handle.requests == 12 + 4
    assert metrics["rollout/partial_samples_ratio"] == 1.0
    assert "perf/rollout_tail_time" not in metrics  # they finished in rollout 0: no tail here
    assert all(s.reward == 1.0 and s.response == " bc" for g in groups for s in g)
    assert all(s.metadata["scored"] == 1 for g in groups for s in g)  # not scored again


def test_fill_from_output_appends_a_continuation():
    s = Sample(index=0, tokens=[1, 2])
    fill_from_output(s, output([7, 8, 9], [-0.1, -0.2, -0.3], " ab", "abort", "3"))
    assert s.status is Status.ABORTED and s.response_length == 3
    fill_from_output(s, output([4, 5], [-0.4, -0.5], "c", "stop", "4"))
    assert s.tokens == [1, 2, 7, 8, 9, 4, 5] and s.response == " abc" and s.prompt_length == 2
    assert s.rollout_log_probs == [-0.1, -0.2, -0.3, -0.4, -0.5] and s.loss_mask == [1] * 5
    assert s.weight_versions == ["3", "4"] and s.token_weight_versions == ["3"] * 3 + ["4"] * 2
    assert s.status is Status.COMPLETED
    # the two requests' counters summed: 4 verify passes, 1 + 0 drafts accepted, 8 drafted
    assert s.spec_info["spec_verify_ct"] == 4 and s.spec_info["spec_draft_token_num"] == 8
    assert s.spec_info["spec_accept_length"] == (1 + 0 + 4) / 4
    # Aborted before its first token (waiting, or on its way in): no version added to it.
    waiting = Sample(index=1, tokens=[1, 2])
    fill_from_output(waiting, output([], [], "", "abort", "3"))
    assert waiting.status is Status.ABORTED and waiting.weight_versions == []
    fill_from_output(waiting, output([4], [-0.4], "c", "stop", "4"))
    assert waiting.weight_versions == ["4"] and waiting.token_weight_versions == ["4"]
    custom = Sample(index=3, tokens=[1, 2, 7], response_length=1)  # no log-probs recorded
    with pytest.raises(ValueError, match="sample 3 continues a response of 1 tokens"):
        fill_from_output(custom, output([4], [-0.4], "c", "stop", "4"))


class NoEngine:
    async def async_generate(self, **kwargs):
        raise AssertionError(f"no request expected, got {kwargs}")


def test_a_continued_sample_at_the_length_limit_ends_truncated_without_a_request():
    s = Sample(index=0, tokens=[1, 2, 3, 4], response_length=2, rollout_log_probs=[-1.0, -1.0])
    s.status = Status.ABORTED
    args = RolloutArgs(rollout_batch_size=1, partial_rollout=True)
    asyncio.run(generate(args, s, {"max_new_tokens": 2}, NoEngine()))
    assert s.status is Status.TRUNCATED and s.tokens == [1, 2, 3, 4]


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(mask_offpolicy_in_partial_rollout=True), "it needs --partial-rollout"),
        (dict(partial_rollout=True, rollout_function_path="m:f"), "--rollout-function-path m:f"),
    ],
)
def test_partial_rollout_flags_are_checked(kwargs, match):
    with pytest.raises(ValueError, match=match):
        RolloutArgs(rollout_batch_size=1, **kwargs)


class Clock:
    """time.monotonic for rollout.generate: the time a test engine says its request finished."""

    def __init__(self) -> None:
        self.now = 0.0

    def monotonic(self) -> float:
        return self.now


class ScheduledEngine:
    """Each request finishes at the time `finish_at` gives for its sample (by sampling seed:
    the sample index with --rollout-seed 0), on `clock`."""

    def __init__(self, clock: Clock, finish_at: dict[int, float]) -> None:
        self.clock, self.finish_at = clock, finish_at

    async def async_generate(self, input_ids, sampling_params, **kwargs):
        await asyncio.sleep(0)  # every request in flight before any finishes
        self.clock.now = self.finish_at[sampling_params["sampling_seed"]]
        return output([7, 8], [-0.5, -0.5], " bc", "stop", "0")

    def abort_request(self, rid: str) -> None:
        pass


def test_the_tail_runs_from_the_first_to_the_last_finished_response(
    tokenizer, tmp_path, monkeypatch
):
    data = str(tmp_path / "task.jsonl")
    write_tiny_task(data, tokenizer, n=16)
    clock = Clock()
    monkeypatch.setattr("rollout.generate.time", clock)
    # two groups of two samples (indices 0-3), finishing at these times: the tail is 7.5 - 3.0
    finish_at = {0: 5.0, 1: 7.5, 2: 3.0, 3: 4.25}
    args = partial_args(data, rollout_seed=0, over_sampling_batch_size=2, partial_rollout=False)
    manager = RolloutManager(args, [ScheduledEngine(clock, finish_at)], tokenizer)
    groups, metrics = manager.generate(0)
    assert [s.finish_time for g in groups for s in g] == [5.0, 7.5, 3.0, 4.25]
    assert metrics["perf/rollout_tail_time"] == 7.5 - 3.0


class CountingEngine:
    """Reports as its running requests those inside async_generate, and lets one of them finish
    after each report: the polls see 4, 3, 2, 1. Its first poll, and any while it holds none,
    fail (a poll never fails the rollout) and count nothing."""

    def __init__(self) -> None:
        self.held: list[asyncio.Event] = []
        self.polls = 0

    async def async_generate(self, input_ids, sampling_params, **kwargs):
        release = asyncio.Event()
        self.held.append(release)
        await release.wait()
        self.held.remove(release)
        return output([7, 8], [-0.5, -0.5], " bc", "stop", "0")

    async def get_load(self, include=None):
        self.polls += 1
        if self.polls == 1 or not self.held:
            raise RuntimeError("no load to report")
        running = len(self.held)
        self.held[0].set()
        return {"loads": [{"num_running_reqs": running}]}

    def abort_request(self, rid: str) -> None:
        for release in self.held:  # an aborted request ends
            release.set()


def test_the_engines_batch_size_is_polled_while_the_batch_fills(tokenizer, tmp_path):
    data = str(tmp_path / "task.jsonl")
    write_tiny_task(data, tokenizer, n=16)
    args = partial_args(data, over_sampling_batch_size=2, partial_rollout=False)
    manager = RolloutManager(args, [CountingEngine()], tokenizer)
    manager.batch_size_poll_interval = 0.01
    # the polls let the requests finish: a poller that stopped would hang the rollout
    _, metrics = asyncio.run(asyncio.wait_for(manager.agenerate(0), timeout=10))
    assert manager.batch_size_trace.running == [[4], [3], [2], [1]]
    times = manager.batch_size_trace.times
    assert len(times) == 4 and times == sorted(times) and times[0] >= 0.01
    assert metrics["perf/engine_batch_size/mean"] == 2.5
    assert metrics["perf/engine_batch_size/max"] == 4.0
