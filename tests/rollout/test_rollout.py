"""RolloutManager against real in-process engines on a tiny random checkpoint."""

from __future__ import annotations

import asyncio
import json

import pytest
import torch
from transformers import AutoTokenizer

from rollout import MetricsLogger, RolloutArgs, RolloutManager, Sample, Status
from rollout.debug_data import load_debug_rollout_data, save_debug_rollout_data
from rollout.generate import fill_from_output, generate
from rollout.tiny_task import write_tiny_task
from spec_engine import Engine

DESIGN_KEYS = (
    "rollout/raw_reward",
    "rollout/response_len/mean",
    "rollout/response_len/median",
    "rollout/response_len/max",
    "rollout/response_len/min",
    "rollout/truncated_ratio",
    "perf/rollout_time",
    "perf/tokens_per_s",
)


@pytest.fixture(scope="module")
def engine(llama_path):
    with Engine(model_path=llama_path, random_seed=0) as e:
        yield e


@pytest.fixture(scope="module")
def tokenizer(llama_path):
    return AutoTokenizer.from_pretrained(llama_path)


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory, tokenizer) -> str:
    path = str(tmp_path_factory.mktemp("data") / "tiny.jsonl")
    write_tiny_task(path, tokenizer, n=16)
    return path


def make_args(data: str, **kwargs) -> RolloutArgs:
    defaults = dict(
        rollout_batch_size=3,
        n_samples_per_prompt=4,
        prompt_data=data,
        label_key="label",
        rm_type="tiny",
        rollout_max_response_len=6,
    )
    defaults.update(kwargs)
    return RolloutArgs(**defaults)


def idle(engine) -> bool:
    state = engine.get_server_info()["internal_states"][0]
    return state["num_running_reqs"] == 0 and state["num_waiting_reqs"] == 0


@pytest.fixture(scope="module")
def rollout(engine, tokenizer, tiny_data):
    manager = RolloutManager(make_args(tiny_data), [engine], tokenizer)
    groups, metrics = manager.generate(0)
    return manager, groups, metrics


def test_rollout_groups(rollout, tokenizer):
    manager, groups, metrics = rollout
    assert [len(g) for g in groups] == [4, 4, 4]
    for group in groups:
        assert len({s.group_index for s in group}) == 1 and len({s.prompt for s in group}) == 1
    samples = [s for g in groups for s in g]
    assert sorted(s.index for s in samples) == list(range(12))
    for s in samples:
        prompt_ids = tokenizer(s.prompt)["input_ids"]
        assert s.tokens[: len(prompt_ids)] == prompt_ids and s.prompt_length == len(prompt_ids)
        assert 1 <= s.response_length <= 6
        assert len(s.loss_mask) == len(s.rollout_log_probs) == s.response_length and set(
            s.loss_mask
        ) == {1}
        assert all(lp <= 0 for lp in s.rollout_log_probs)
        assert s.reward in (0.0, 1.0) and s.weight_versions == ["default"] and s.spec_info is None
        # TRUNCATED exactly when max_new_tokens was reached without an EOS
        eos = s.tokens[-1] == tokenizer.eos_token_id
        assert s.status is (Status.COMPLETED if eos else Status.TRUNCATED)
        assert s.status is Status.COMPLETED or s.response_length == 6
    assert any(s.status is Status.TRUNCATED for s in samples)
    position = {"shuffle": False, "seed": 42, "num_prompts": 16, "buffer": []}
    assert manager.data_source.state_dict() == {"epoch": 0, "offset": 3, **position}
    assert metrics["rollout/groups_submitted"] == 3 and metrics["rollout/groups_leftover"] == 0
    assert metrics["rollout/raw_reward"] == sum(s.reward for s in samples) / 12
    assert (
        metrics["rollout/truncated_ratio"]
        == sum(s.status is Status.TRUNCATED for s in samples) / 12
    )


def test_rollout_log_probs_are_the_models(rollout, hf, llama_path, engine):
    _, groups, _ = rollout
    s = groups[1][2]
    # The oracle: transformers' log-softmax (temperature 1) of the sampled tokens.
    with torch.no_grad():
        logits = hf.model(llama_path)(torch.tensor([s.tokens])).logits[0].float()
    logp = torch.log_softmax(logits[s.prompt_length - 1 : -1], -1)
    expected = logp.gather(-1, torch.tensor(s.response_tokens)[:, None])[:, 0]
    assert torch.allclose(torch.tensor(s.rollout_log_probs), expected, atol=1e-4)
    # The per-sample seed makes the engine repeat the sample on its own.
    again = engine.generate(
        input_ids=s.tokens[: s.prompt_length],
        return_logprob=True,
        sampling_params={
            "max_new_tokens": 6,
            "temperature": 1.0,
            "top_p": 1.0,
            "top_k": -1,
            "skip_special_tokens": False,
            "sampling_seed": 42 * 2**32 + s.index,
        },
    )
    assert again["output_ids"] == s.response_tokens
    # Equal up to float rounding: the batch composition (and prefix cache) differ from the
    # rollout's.
    assert [lp for lp, _, _ in again["meta_info"]["output_token_logprobs"]] == pytest.approx(
        s.rollout_log_probs, abs=1e-5
    )


def test_stop_tokens_complete(engine, tokenizer, tiny_data):
    args = make_args(
        tiny_data,
        rollout_batch_size=1,
        n_samples_per_prompt=2,
        rollout_stop_token_ids=list(range(512)),
    )
    groups, _ = RolloutManager(args, [engine], tokenizer).generate(0)
    assert all(s.status is Status.COMPLETED and s.response_length == 1 for s in groups[0])


def test_debug_data_and_metrics_files(rollout, tmp_path):
    _, groups, metrics = rollout
    template = str(tmp_path / "debug" / "rollout_{rollout_id}.pt")
    save_debug_rollout_data(template, 0, groups)
    raw = torch.load(str(tmp_path / "debug" / "rollout_0.pt"), weights_only=True)
    assert (
        raw["rollout_id"] == 0
        and len(raw["samples"]) == 12
        and raw["samples"][0]["status"] in ("COMPLETED", "TRUNCATED")
    )
    assert load_debug_rollout_data(template, 0) == groups
    with MetricsLogger(str(tmp_path / "out")) as logger:
        logger.log(0, metrics)
    record = json.loads((tmp_path / "out" / "metrics.jsonl").read_text())
    assert record["step"] == 0 and set(DESIGN_KEYS) <= set(record)


class AbortSpy:
    """An engine handle that records the rids it was asked to abort."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.aborted: list[str] = []

    async def async_generate(self, **kwargs):
        return await self.engine.async_generate(**kwargs)

    def abort_request(self, rid: str) -> None:
        self.aborted.append(rid)
        self.engine.abort_request(rid)


def group_rm(args, sample):
    """All-equal rewards for label-'a' groups (dropped by the filter), mixed ones otherwise."""
    return 0.0 if sample.label == "a" else float(sample.index % 2)


def test_dynamic_filter_drops_groups_and_aborts_leftovers(llama_path, tokenizer, tmp_path):
    data = tmp_path / "ab.jsonl"
    data.write_text(
        "".join(json.dumps({"input": f"copy: {c}", "label": c}) + "\n" for c in "aabababaaabb")
    )
    args = make_args(
        str(data),
        rollout_batch_size=2,
        n_samples_per_prompt=2,
        rm_type=None,
        custom_rm_path="tests.rollout.test_rollout:group_rm",
        over_sampling_batch_size=6,
        rollout_max_response_len=48,
        dynamic_sampling_filter_path="rollout.filters:check_reward_nonzero_std",
    )
    # Two running requests at a time: later groups are still queued or running when two are kept.
    with Engine(model_path=llama_path, random_seed=0, max_running_requests=2) as small:
        spy = AbortSpy(small)
        manager = RolloutManager(args, [spy], tokenizer)
        groups, metrics = manager.generate(0)
        assert idle(small) and manager.router.in_flight == []
    assert spy.aborted and all(rid.startswith("rollout-") for rid in spy.aborted)
    assert len(groups) == 2 and all(s.label == "b" for g in groups for s in g)
    assert all(len({s.reward for s in g}) == 2 for g in groups)
    assert metrics["rollout/groups_filtered"] >= 1 and metrics["rollout/groups_leftover"] >= 1
    assert (
        metrics["rollout/groups_submitted"]
        == 6
        == 2 + sum(metrics[f"rollout/groups_{k}"] for k in ("filtered", "aborted", "leftover"))
    )
    assert metrics["rollout/raw_reward"] == 0.5
    # The aborted leftovers did not run to their full length.
    assert metrics["perf/tokens_per_s"] * metrics["perf/rollout_time"] < 6 * 2 * 48


def test_filter_that_drops_everything_fails_naming_the_flag(engine, tokenizer, tiny_data):
    args = make_args(
        tiny_data,
        rollout_batch_size=1,
        n_samples_per_prompt=1,
        dynamic_sampling_max_groups=3,
        dynamic_sampling_filter_path="rollout.filters.check_reward_nonzero_std",
    )
    with pytest.raises(RuntimeError, match="--dynamic-sampling-max-groups"):
        RolloutManager(args, [engine], tokenizer).generate(0)
    assert idle(engine)


def test_speculative_engine_fills_spec_info(llama_path, tokenizer, tiny_data):
    args = make_args(
        tiny_data,
        rollout_batch_size=2,
        n_samples_per_prompt=2,
        rollout_max_response_len=12,
        rollout_temperature=0.0,
    )
    with Engine(
        model_path=llama_path,
        random_seed=0,
        speculative_algorithm="NGRAM",
        speculative_num_draft_tokens=4,
    ) as spec:
        groups, metrics = RolloutManager(args, [spec], tokenizer).generate(0)
    samples = [s for g in groups for s in g]
    for s in samples:
        info = s.spec_info
        assert info["spec_verify_ct"] >= 1
        assert info["spec_accept_length"] == pytest.approx(
            (info["spec_accept_token_num"] + info["spec_verify_ct"]) / info["spec_verify_ct"]
        )
    verify = sum(s.spec_info["spec_verify_ct"] for s in samples)
    accepted = sum(s.spec_info["spec_accept_token_num"] for s in samples)
    assert metrics["rollout/spec_accept_length"] == pytest.approx((accepted + verify) / verify)
    assert accepted > 0 and 0.0 < metrics["rollout/spec_accept_rate"] <= 1.0


def constant_rm(args, sample):
    return 0.5


async def one_token_generate(args, sample, sampling_params, engine):
    output = await engine.async_generate(
        input_ids=list(sample.tokens),
        return_logprob=True,
        sampling_params={**sampling_params, "max_new_tokens": 1},
    )
    sample.metadata["custom"] = True
    return fill_from_output(sample, output)


def test_custom_generate_and_rm_paths(engine, tokenizer, tiny_data):
    args = make_args(
        tiny_data,
        rollout_batch_size=2,
        n_samples_per_prompt=2,
        rm_type=None,
        custom_rm_path="tests.rollout.test_rollout:constant_rm",
        custom_generate_function_path="tests.rollout.test_rollout:one_token_generate",
    )
    groups, metrics = RolloutManager(args, [engine], tokenizer).generate(0)
    samples = [s for g in groups for s in g]
    assert all(s.reward == 0.5 and s.response_length == 1 and s.metadata["custom"] for s in samples)
    assert metrics["rollout/raw_reward"] == 0.5


async def failing_generate(args, sample, sampling_params, engine):
    if sample.index == 5:
        await asyncio.sleep(0.01)  # fail while the other samples are generating
        raise ValueError("boom")
    return await generate(args, sample, sampling_params, engine)


def test_a_failing_sample_fails_the_rollout_and_stops_the_rest(engine, tokenizer, tiny_data):
    args = make_args(
        tiny_data,
        rollout_max_response_len=200,
        custom_generate_function_path="tests.rollout.test_rollout:failing_generate",
    )
    manager = RolloutManager(args, [engine], tokenizer)
    with pytest.raises(ValueError, match="boom"):
        manager.generate(0)
    assert idle(engine) and manager.router.in_flight == []


def prompt_only_rollout(args, rollout_id, manager):
    """A --rollout-function-path rollout that needs no engine: echo the label as the response."""
    groups = []
    for prompt in manager.data_source.get_prompts(args.rollout_batch_size):
        groups.append(
            [
                Sample(
                    group_index=rollout_id,
                    index=i,
                    prompt=prompt.prompt,
                    tokens=prompt.tokens + [7],
                    response=prompt.label,
                    response_length=1,
                    label=prompt.label,
                    reward=1.0,
                    loss_mask=[1],
                    rollout_log_probs=[0.0],
                    status=Status.COMPLETED,
                )
                for i in range(args.n_samples_per_prompt)
            ]
        )
    return groups


def test_rollout_function_path(tokenizer, tiny_data):
    args = make_args(
        tiny_data, rollout_function_path="tests.rollout.test_rollout:prompt_only_rollout"
    )
    groups, metrics = RolloutManager(args, [], tokenizer).generate(5)
    assert [len(g) for g in groups] == [4, 4, 4] and groups[0][0].group_index == 5
    assert metrics["rollout/raw_reward"] == 1.0


def test_eval(engine, tokenizer, tiny_data):
    args = make_args(
        tiny_data,
        eval_prompt_data=["tiny", tiny_data],
        n_samples_per_eval_prompt=2,
        eval_max_response_len=2,
    )
    manager = RolloutManager(args, [engine], tokenizer)
    results, metrics = manager.eval(0)
    assert len(results["tiny"]) == 16 and all(len(g) == 2 for g in results["tiny"])
    assert all(s.response_length <= 2 for g in results["tiny"] for s in g)
    assert 0.0 <= metrics["eval/tiny"] <= 1.0 and "eval/tiny/response_len/mean" in metrics
    again, _ = manager.eval(1)  # the same seeds every evaluation: comparable numbers across steps
    assert [s.tokens for g in again["tiny"] for s in g] == [
        s.tokens for g in results["tiny"] for s in g
    ]
    # eval leaves the training order alone
    assert manager.data_source.state_dict() == {
        "epoch": 0,
        "offset": 0,
        "shuffle": False,
        "seed": 42,
        "num_prompts": 16,
        "buffer": [],
    }
