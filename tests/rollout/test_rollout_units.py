"""rollout/ pieces that need no engine: Sample, flags, data source, rewards, filters, router,
metrics, debug data, the tiny task."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import types

import pytest
from transformers import AutoTokenizer

from rollout import RolloutArgs, Sample, Status, add_cli_args, from_cli_args
from rollout.data_source import DataSource
from rollout.debug_data import load_debug_rollout_data, save_debug_rollout_data
from rollout.filters import check_reward_nonzero_std, load_filter
from rollout.loader import load_function
from rollout.metrics import MetricsLogger, rollout_metrics, staleness_metrics
from rollout.rewards import load_reward_fn, score
from rollout.rewards.boxed_math import answers_match, boxed_math_rm, extract_boxed
from rollout.rewards.exact_match import exact_match_rm
from rollout.rewards.tiny import tiny_rm
from rollout.router import RequestAborted, Router
from rollout.tiny_task import letter_shares, write_tiny_task


def make_sample(**kwargs) -> Sample:
    defaults = dict(
        group_index=0,
        index=0,
        prompt="p",
        tokens=[5, 6, 7, 8],
        response="ab",
        response_length=2,
        label="a",
        reward=1.0,
        loss_mask=[1, 1],
        rollout_log_probs=[-0.5, -1.5],
        status=Status.COMPLETED,
        weight_versions=["default"],
    )
    defaults.update(kwargs)
    return Sample(**defaults)


def args_for(**kwargs) -> RolloutArgs:
    return RolloutArgs(rollout_batch_size=kwargs.pop("rollout_batch_size", 2), **kwargs)


# ------------------------------------------------------------ Sample


def test_sample_round_trip():
    s = make_sample(
        prompt=[{"role": "user", "content": "hi"}],
        status=Status.TRUNCATED,
        metadata={"k": [1, 2]},
        spec_info={
            "spec_verify_ct": 3,
            "spec_accept_length": 2.0,
            "spec_accept_token_num": 3,
            "spec_draft_token_num": 9,
        },
    )
    d = s.to_dict()
    assert d["status"] == "TRUNCATED" and json.loads(json.dumps(d)) == d  # plain values only
    back = Sample.from_dict(d)
    assert back == s and back.status is Status.TRUNCATED
    assert back.prompt_length == 2 and back.response_tokens == [7, 8]
    with pytest.raises(ValueError, match="unknown Sample fields.*'rewards'"):
        Sample.from_dict({**d, "rewards": 1})


def test_status_from_finish_reason():
    assert Status.from_finish_reason({"type": "stop", "matched": 2}) is Status.COMPLETED
    assert Status.from_finish_reason({"type": "length", "length": 4}) is Status.TRUNCATED
    assert Status.from_finish_reason({"type": "abort", "message": "x"}) is Status.ABORTED
    with pytest.raises(ValueError, match="unknown finish_reason"):
        Status.from_finish_reason(None)


# ------------------------------------------------------------ flags


def test_cli_round_trip_and_defaults():
    parser = argparse.ArgumentParser()
    add_cli_args(parser)
    ns = parser.parse_args(
        [
            "--rollout-batch-size",
            "3",
            "--n-samples-per-prompt",
            "4",
            "--rollout-stop",
            "a",
            "b",
            "--rollout-stop-token-ids",
            "7",
            "--apply-chat-template",
            "--rm-type",
            "boxed_math",
            "--eval-prompt-data",
            "gsm",
            "/d/gsm.jsonl",
        ]
    )
    args = from_cli_args(ns)
    assert (args.rollout_batch_size, args.n_samples_per_prompt) == (3, 4)
    assert (
        args.rollout_stop == ["a", "b"]
        and args.rollout_stop_token_ids == [7]
        and args.apply_chat_template
    )
    assert args.eval_datasets == [("gsm", "/d/gsm.jsonl")]
    # slime's defaults
    assert (args.rollout_temperature, args.rollout_top_p, args.rollout_top_k, args.input_key) == (
        1.0,
        1.0,
        -1,
        "input",
    )
    assert args.over_sampling_size == 3 and args.max_groups == 30
    assert from_cli_args(ns, rollout_batch_size=5).rollout_batch_size == 5
    with pytest.raises(SystemExit):  # --rollout-batch-size is required
        parser.parse_args([])
    assert "--rollout-temperature" in parser.format_help()


@pytest.mark.parametrize(
    "kwargs,flag",
    [
        (dict(rollout_batch_size=0), "--rollout-batch-size"),
        (dict(n_samples_per_prompt=0), "--n-samples-per-prompt"),
        (dict(rollout_top_p=0.0), "--rollout-top-p"),
        (dict(rollout_top_k=0), "--rollout-top-k"),
        (dict(rollout_temperature=-1.0), "--rollout-temperature"),
        (dict(over_sampling_batch_size=0), "--over-sampling-batch-size"),
        (dict(rm_type="nope"), "--rm-type"),
        (dict(rm_type="tiny", custom_rm_path="a:b"), "--custom-rm-path"),
        (dict(save_debug_rollout_data="/tmp/x.pt"), "{rollout_id}"),
        (dict(eval_prompt_data=["only-a-name"]), "--eval-prompt-data"),
    ],
)
def test_validation_names_the_flag(kwargs, flag):
    with pytest.raises(ValueError, match=flag.replace("{", r"\{").replace("}", r"\}")):
        args_for(**kwargs)


# ------------------------------------------------------------ data source


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir):
    return AutoTokenizer.from_pretrained(tokenizer_dir)


def write_jsonl(path, records) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def test_data_source_epochs_and_deterministic_shuffle(tmp_path, tokenizer):
    path = write_jsonl(
        tmp_path / "p.jsonl",
        [{"input": f"q{i}", "label": str(i), "metadata": {"i": i}} for i in range(5)],
    )
    plain = DataSource(path, tokenizer, label_key="label")
    assert [s.label for s in plain.get_prompts(7)] == [
        "0",
        "1",
        "2",
        "3",
        "4",
        "0",
        "1",
    ]  # wraps into epoch 1
    assert plain.state_dict() == {
        "epoch": 1,
        "offset": 2,
        "shuffle": False,
        "seed": 42,
        "num_prompts": 5,
        "buffer": [],
    }

    def labels(source, n):
        return [s.label for s in source.get_prompts(n)]

    a, b = (DataSource(path, tokenizer, label_key="label", shuffle=True, seed=3) for _ in range(2))
    epochs_a = [labels(a, 5) for _ in range(3)]
    assert epochs_a == [labels(b, 5) for _ in range(3)]  # same seed, same order
    assert all(
        sorted(e) == ["0", "1", "2", "3", "4"] for e in epochs_a
    )  # each epoch is a permutation
    assert len({tuple(e) for e in epochs_a}) > 1  # reshuffled per epoch
    c = DataSource(path, tokenizer, label_key="label", shuffle=True, seed=3)
    labels(c, 7)
    resumed = DataSource(path, tokenizer, label_key="label", shuffle=True, seed=3)
    resumed.load_state_dict(c.state_dict())
    assert labels(resumed, 8) == labels(c, 8)
    with pytest.raises(ValueError, match="--rollout-shuffle True with --rollout-seed 3"):
        DataSource(path, tokenizer, label_key="label", shuffle=True).load_state_dict(c.state_dict())
    with pytest.raises(ValueError, match="saved reading 9 prompts"):
        plain.load_state_dict({**c.state_dict(), "shuffle": False, "seed": 42, "num_prompts": 9})

    grown = write_jsonl(
        tmp_path / "grown.jsonl",
        [{"input": f"q{i}", "label": str(i), "metadata": {"i": i}} for i in range(8)],
    )
    short = DataSource(path, tokenizer, label_key="label")
    labels(short, 4)
    longer = DataSource(grown, tokenizer, label_key="label")
    longer.load_state_dict(short.state_dict())  # appended prompts, file order, epoch 0: read on
    assert labels(longer, 5) == ["4", "5", "6", "7", "0"]
    labels(short, 3)  # into epoch 1: the longer file's epochs would have cut elsewhere
    with pytest.raises(ValueError, match=r"saved reading 5 prompts \(offset 2, epoch 1\)"):
        DataSource(grown, tokenizer, label_key="label").load_state_dict(short.state_dict())
    with pytest.raises(ValueError, match="grown by appending resumes only unshuffled"):
        DataSource(grown, tokenizer, label_key="label", shuffle=True, seed=3).load_state_dict(
            {**c.state_dict(), "epoch": 0, "offset": 2}
        )

    first = plain.all_prompts()[2]
    assert first.prompt == "q2" and first.metadata == {"i": 2}
    assert first.tokens == tokenizer("q2")["input_ids"]


def test_data_source_chat_template(tmp_path, tokenizer):
    path = write_jsonl(
        tmp_path / "c.jsonl",
        [
            {"input": "hello"},
            {
                "input": [
                    {"role": "system", "content": "be brief"},
                    {"role": "user", "content": "hi"},
                ]
            },
        ],
    )
    source = DataSource(path, tokenizer, apply_chat_template=True)
    user, chat = source.get_prompts(2)
    assert user.prompt == "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"
    assert chat.prompt.startswith("<|im_start|>system\nbe brief<|im_end|>\n")
    assert user.tokens == tokenizer(user.prompt, add_special_tokens=False)["input_ids"]
    assert user.label is None
    with pytest.raises(ValueError, match="--apply-chat-template"):
        DataSource(path, tokenizer)


def test_data_source_errors_name_the_flag(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "e.jsonl", [{"question": "x"}])
    with pytest.raises(ValueError, match=r"line 1 has no key 'input'.*--input-key"):
        DataSource(path, tokenizer)
    with pytest.raises(ValueError, match="--label-key"):
        DataSource(path, tokenizer, input_key="question", label_key="answer")
    with pytest.raises(ValueError, match="--prompt-data"):
        DataSource.from_args(args_for(), tokenizer)


# ------------------------------------------------------------ rewards


def test_extract_boxed_nested_and_last():
    assert extract_boxed(r"so \boxed{1} then \boxed{\frac{x^{2}}{2}} done") == r"\frac{x^{2}}{2}"
    assert extract_boxed(r"\boxed{\{1, 2\}}") == r"\{1, 2\}"
    assert extract_boxed(r"$\boxed 7$") == "7"
    assert extract_boxed(r"\fbox{3}") == "3"
    assert extract_boxed(r"cut off \boxed{\frac{1}{") is None
    assert extract_boxed("no box") is None


@pytest.mark.parametrize(
    "answer,label,match",
    [
        ("1/2", "0.5", True),
        (r"\frac{1}{2}", "0.5", True),
        (r"\dfrac12", "0.5", False),
        ("1,000", "1000", True),
        ("x = 5", "5", True),
        (r"5^\circ", "5", True),
        (r"50\%", "50", True),
        (r"\text{ Paris }", "Paris", True),
        ("0.333", "1/3", False),
        ("3.", "3", True),
        ("-2/4", "-0.5", True),
        (r"\{1,2\}", r"\{1, 2\}", True),
        ("a+b", "b+a", False),
    ],
)
def test_answers_match(answer, label, match):
    assert answers_match(answer, label) is match


def test_builtin_rewards():
    args = args_for()
    assert (
        boxed_math_rm(args, make_sample(response=r"thus \boxed{\frac{1}{2}}.", label="0.5")) == 1.0
    )
    assert boxed_math_rm(args, make_sample(response=r"\boxed{3}", label=r"\boxed{3}")) == 1.0
    assert boxed_math_rm(args, make_sample(response="3", label="3")) == 0.0  # no box, no credit
    assert exact_match_rm(args, make_sample(response="  Paris\n", label="Paris")) == 1.0
    assert exact_match_rm(args, make_sample(response="paris", label="Paris")) == 0.0
    assert tiny_rm(args, make_sample(response=" Bird", label="b")) == 1.0
    assert tiny_rm(args, make_sample(response="cat", label="b")) == 0.0
    assert tiny_rm(args, make_sample(response="", label="b")) == 0.0
    with pytest.raises(ValueError, match="--label-key"):
        exact_match_rm(args, make_sample(label=None))


def sync_rm(args, sample):
    return len(sample.response)


async def async_rm(args, sample):
    return 0.25


def bad_rm(args, sample):
    return "1"


def test_load_reward_fn():
    assert load_reward_fn(args_for(rm_type="tiny")) is tiny_rm
    assert (
        load_reward_fn(args_for(custom_rm_path="tests.rollout.test_rollout_units:sync_rm")).__name__
        == "sync_rm"
    )
    with pytest.raises(ValueError, match="--rm-type"):
        load_reward_fn(args_for())
    sample = make_sample(response="abc")
    assert (
        asyncio.run(
            score(
                load_reward_fn(
                    args_for(custom_rm_path="tests.rollout.test_rollout_units.async_rm")
                ),
                args_for(),
                sample,
            )
        )
        == 0.25
    )
    assert asyncio.run(score(sync_rm, args_for(), sample)) == 3.0
    with pytest.raises(TypeError, match="must return a float"):
        asyncio.run(score(bad_rm, args_for(), sample))


def test_load_function_errors_name_the_flag():
    assert (
        load_function("rollout.filters:check_reward_nonzero_std", "--x") is check_reward_nonzero_std
    )
    assert (
        load_function("rollout.filters.check_reward_nonzero_std", "--x") is check_reward_nonzero_std
    )
    with pytest.raises(ImportError, match="--custom-rm-path 'no_such_module:f'"):
        load_function("no_such_module:f", "--custom-rm-path")
    with pytest.raises(ImportError, match="has no attribute 'nope'"):
        load_function("rollout.filters:nope", "--custom-rm-path")
    with pytest.raises(ValueError, match="not an import path"):
        load_function("justaname", "--custom-rm-path")


# ------------------------------------------------------------ filters


def test_check_reward_nonzero_std():
    args = args_for(dynamic_sampling_filter_path="rollout.filters.check_reward_nonzero_std")
    assert load_filter(args) is check_reward_nonzero_std and load_filter(args_for()) is None
    assert not check_reward_nonzero_std(args, [make_sample(reward=1.0), make_sample(reward=1.0)])
    assert check_reward_nonzero_std(args, [make_sample(reward=1.0), make_sample(reward=0.0)])
    with pytest.raises(ValueError, match="without a reward"):
        check_reward_nonzero_std(args, [make_sample(reward=None)])


# ------------------------------------------------------------ router


class FakeEngine:
    def __init__(self, name: str, async_abort: bool = False) -> None:
        self.name = name
        self.aborted: list[str] = []
        self.async_abort = async_abort
        self.release = asyncio.Event()

    async def async_generate(self, **kwargs):
        await self.release.wait()
        return {"engine": self.name, "rid": kwargs["rid"]}

    def abort_request(self, rid):
        if self.async_abort:

            async def later():
                self.aborted.append(rid)

            return later()
        self.aborted.append(rid)


def test_router_least_outstanding_with_round_robin_ties():
    router = Router([FakeEngine("a"), FakeEngine("b"), FakeEngine("c")])
    assert [router.choose() for _ in range(4)] == [0, 1, 2, 0]  # all idle: round robin
    with router.lease("r1") as l1, router.lease("r2") as l2:
        assert (l1.engine_index, l2.engine_index) == (1, 2)
        assert router.outstanding == [0, 1, 1]
        with router.lease("r3") as l3:
            assert l3.engine_index == 0  # the only idle engine
        with router.lease("r4") as l4:
            assert l4.engine_index == 0
            assert router.outstanding == [1, 1, 1]
            with router.lease("r5") as l5:  # all equal again: round robin continues after 0
                assert l5.engine_index == 1
                assert router.outstanding == [1, 2, 1]
                with router.lease("r6") as l6:
                    assert l6.engine_index in (0, 2)
    assert router.outstanding == [0, 0, 0] and router.in_flight == []
    with router.lease("same"):
        with pytest.raises(ValueError, match="already in flight"):
            with router.lease("same"):
                pass


def test_router_abort_all_by_prefix():
    engines = [FakeEngine("a"), FakeEngine("b", async_abort=True)]
    router = Router(engines)

    async def run():
        async def request(rid):
            with router.lease(rid) as engine:
                return await engine.async_generate(input_ids=[1])

        tasks = [asyncio.ensure_future(request(rid)) for rid in ("x-1", "x-2", "y-1")]
        await asyncio.sleep(0)  # let them take their leases
        assert sorted(router.in_flight) == ["x-1", "x-2", "y-1"]
        assert await router.abort_all("x-") == 2
        for e in engines:
            e.release.set()
        return await asyncio.gather(*tasks)

    results = asyncio.run(run())
    assert sorted(engines[0].aborted + engines[1].aborted) == ["x-1", "x-2"]
    assert [r["rid"] for r in results] == ["x-1", "x-2", "y-1"]

    async def aborted_before_send():
        with router.lease("z") as lease:
            await router.abort_all()
            await lease.async_generate(input_ids=[1])

    with pytest.raises(RequestAborted):
        asyncio.run(aborted_before_send())


# ------------------------------------------------------------ metrics


def test_rollout_metrics_values():
    spec = {
        "spec_verify_ct": 4,
        "spec_accept_length": 2.0,
        "spec_accept_token_num": 4,
        "spec_draft_token_num": 16,
    }
    groups = [
        [
            make_sample(reward=1.0, response_length=2, spec_info=spec),
            make_sample(
                reward=0.0,
                response_length=6,
                status=Status.TRUNCATED,
                spec_info={**spec, "spec_verify_ct": 2, "spec_accept_token_num": 0},
            ),
        ]
    ]
    m = rollout_metrics(groups, rollout_time=2.0, response_tokens=20)
    assert m["rollout/raw_reward"] == 0.5 and m["rollout/truncated_ratio"] == 0.5
    assert (m["rollout/response_len/mean"], m["rollout/response_len/median"]) == (4.0, 4.0)
    assert (m["rollout/response_len/max"], m["rollout/response_len/min"]) == (6.0, 2.0)
    assert (
        m["rollout/spec_accept_length"] == (4 + 6) / 6
    )  # (accepted + bonus tokens) / verify passes
    assert m["rollout/spec_accept_rate"] == 4 / 32
    assert m["perf/rollout_time"] == 2.0 and m["perf/tokens_per_s"] == 10.0
    plain = rollout_metrics([[make_sample()]], rollout_time=1.0)
    assert "rollout/spec_accept_length" not in plain and plain["perf/tokens_per_s"] == 2.0


def test_staleness_counts_the_trained_tokens_only():
    def sample(versions, mask):
        return make_sample(
            response_length=len(mask), token_weight_versions=versions, loss_mask=mask
        )

    # trained at version 3: lags 2, (2, masked), 1, 0
    old = sample(["1", "1", "2", "3"], [1, 0, 1, 1])
    unrecorded = sample(None, [1, 1])  # a custom generate function's: left out
    assert staleness_metrics([[old, unrecorded]], 3) == {
        "rollout/weight_version_lag/mean": 1.0,
        "rollout/weight_version_lag/max": 2.0,
    }
    assert staleness_metrics([[sample(["default"], [1])]], 3) == {}  # not the launcher's versions
    assert staleness_metrics([[sample(["1"], [0])]], 3) == {}  # nothing trained


def test_metrics_logger_jsonl_and_wandb(tmp_path, monkeypatch):
    calls = []
    fake = types.ModuleType("wandb")

    class Run:
        def log(self, values, step):
            calls.append(("log", values, step))

        def finish(self):
            calls.append(("finish",))

    fake.init = lambda **kw: calls.append(("init", kw)) or Run()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    with MetricsLogger(str(tmp_path), use_wandb=True, wandb_project="p") as logger:
        import os

        assert os.environ["WANDB_MODE"] == "offline"
        logger.log(1, {"rollout/raw_reward": 0.5, "perf/rollout_time": float("nan")})
        logger.log(2, {"rollout/raw_reward": 0.75})
        with pytest.raises(TypeError, match="metrics must be numbers"):
            logger.log(3, {"bad": "x"})
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert lines == [
        {"step": 1, "rollout_id": 1, "rollout/raw_reward": 0.5, "perf/rollout_time": None},
        {"step": 2, "rollout_id": 2, "rollout/raw_reward": 0.75},
    ]
    assert calls[0][0] == "init" and calls[0][1]["dir"] == str(tmp_path)
    assert ("log", {"rollout/raw_reward": 0.75}, 2) in calls and calls[-1] == ("finish",)


def test_metrics_logger_resumes_without_losing_lines(tmp_path, monkeypatch):
    """A resumed run appends to metrics.jsonl (readers keep each rollout's last line), continues
    the wandb run by id and purges tensorboard's events from the resumed step on."""
    from specrl.plots import read_metrics

    inits, writers = [], []
    wandb = types.ModuleType("wandb")
    wandb.init = lambda **kw: (
        inits.append(kw) or types.SimpleNamespace(log=lambda *a, **k: None, finish=lambda: None)
    )
    tensorboard = types.ModuleType("torch.utils.tensorboard")

    class Writer:
        def __init__(self, **kw):
            writers.append(kw)

        add_scalar = close = lambda *a, **k: None

    tensorboard.SummaryWriter = Writer
    monkeypatch.setitem(sys.modules, "wandb", wandb)
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", tensorboard)
    with MetricsLogger(str(tmp_path), use_wandb=True, wandb_run_id="abc12345") as logger:
        for step in range(3):  # killed after logging rollout 2; the checkpoint holds rollout 0
            logger.log(step, {"x": float(step)})
    with MetricsLogger(
        str(tmp_path),
        use_wandb=True,
        use_tensorboard=True,
        wandb_run_id="abc12345",
        resume_step=1,
    ) as logger:
        for step in range(1, 4):
            logger.log(step, {"x": 10.0 + step})
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 6 and all('"rollout_id"' in line for line in lines)
    assert [r["x"] for r in read_metrics(str(tmp_path / "metrics.jsonl"))] == [0, 11, 12, 13]
    assert [(kw["id"], kw["resume"]) for kw in inits] == [("abc12345", "allow")] * 2
    assert writers[0]["purge_step"] == 1


def test_metrics_logger_tensorboard(tmp_path):
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match="pip install tensorboard"):
            MetricsLogger(str(tmp_path), use_tensorboard=True)
        return
    with MetricsLogger(str(tmp_path), use_tensorboard=True) as logger:
        logger.log(0, {"rollout/raw_reward": 1.0})
    assert (tmp_path / "tensorboard").is_dir()


# ------------------------------------------------------------ debug data, tiny task


def test_debug_data_round_trip(tmp_path):
    groups = [
        [make_sample(group_index=g, index=2 * g + i, reward=float(i)) for i in range(2)]
        for g in (4, 7)
    ]
    path = save_debug_rollout_data(str(tmp_path / "r_{rollout_id}.pt"), 3, groups)
    assert path.endswith("r_3.pt")
    assert load_debug_rollout_data(str(tmp_path / "r_{rollout_id}.pt"), 3) == groups
    with pytest.raises(FileNotFoundError, match="--save-debug-rollout-data"):
        load_debug_rollout_data(str(tmp_path / "r_{rollout_id}.pt"), 4)


def test_tiny_task_file(tmp_path, tokenizer):
    letters = write_tiny_task(str(tmp_path / "tiny.jsonl"), tokenizer, n=10, num_letters=3)
    records = [json.loads(line) for line in (tmp_path / "tiny.jsonl").read_text().splitlines()]
    assert len(records) == 10 and len(letters) == 3
    assert all(r["input"] == f"copy: {r['label']}" and r["label"] in letters for r in records)
    shares = letter_shares(tokenizer)
    assert min(shares[letter] for letter in letters) >= max(
        s for k, s in shares.items() if k not in letters
    )
    assert all(shares[letter] > 0.02 for letter in letters)  # a random policy succeeds now and then


def test_tiny_task_drift_asks_for_varied_responses_mid_run(tmp_path, tokenizer):
    path = tmp_path / "drift.jsonl"
    write_tiny_task(str(path), tokenizer, n=12, num_letters=3, drift_at=5)
    plain = tmp_path / "plain.jsonl"
    write_tiny_task(str(plain), tokenizer, n=12, num_letters=3)
    records = [json.loads(line) for line in path.read_text().splitlines()]
    before = [json.loads(line) for line in plain.read_text().splitlines()]
    assert [r["input"] for r in records] == [r["input"] for r in before]  # same prompts, order
    assert records[:5] == before[:5]
    assert [r["label"] for r in records[5:]] == [r["label"] + "/vary" for r in before[5:]]
    with pytest.raises(ValueError, match="drift_at must be in"):
        write_tiny_task(str(path), tokenizer, n=12, drift_at=13)
    args = argparse.Namespace()
    assert tiny_rm(args, make_sample(response=" bird bird bird", label="b")) == 1.0
    assert tiny_rm(args, make_sample(response=" bird bird bird", label="b/vary")) == 0.0
    assert tiny_rm(args, make_sample(response=" bird cat bird", label="b/vary")) == 1.0
    assert tiny_rm(args, make_sample(response=" cat dog", label="b/vary")) == 0.0
    assert tiny_rm(args, make_sample(response="bbbb", label="b/vary")) == 0.0


def test_user_functions_get_every_launcher_flag():
    """As in slime, custom functions see the launcher's flags (--hf-checkpoint, --sglang-*),
    with the rollout options as RolloutArgs checked them."""
    from rollout.manager import user_args

    rollout_args = RolloutArgs(rollout_batch_size=2, rollout_stop=["</s>"])
    launcher = argparse.Namespace(
        hf_checkpoint="/ckpt", sglang_speculative_algorithm="EAGLE", rollout_stop=None
    )
    merged = user_args(rollout_args, launcher)
    assert merged.hf_checkpoint == "/ckpt" and merged.sglang_speculative_algorithm == "EAGLE"
    assert merged.rollout_stop == ["</s>"] and merged.rollout_batch_size == 2
    assert user_args(rollout_args, None) is rollout_args
