"""The acceptance alarm: a weight update the draft cannot follow raises it (a warning, server
info, meta_info, rollout/spec_accept_alarm); with --speculative-on-collapse disable the engine
decodes plainly, losslessly, until the next update, then speculates again."""

from __future__ import annotations

import logging
import shutil

import pytest

from rollout.generate import fill_from_output
from rollout.metrics import spec_metrics
from rollout.sample import Sample
from spec_engine import Engine
from spec_engine.args.engine_args import EngineArgs
from spec_engine.launch_server import build_parser
from spec_engine.speculative.accept_alarm import AcceptAlarm
from specrl.train_options import parse_args
from tests.conftest import random_prompts
from tiny.checkpoints import add_mimo_mtp, build_eagle_draft

# 1 + 4 x 4 tokens: the prefill's, then 4 full verify steps of a draft equal to the target.
GREEDY = {"temperature": 0.0, "max_new_tokens": 17, "ignore_eos": True}
PROMPTS = random_prompts(4, 3, 20, seed=40)
# Chain of 3 draft tokens: a draft equal to the target emits 4 tokens per verify step.
STANDALONE = dict(
    speculative_algorithm="STANDALONE",
    speculative_num_steps=3,
    speculative_eagle_topk=1,
    speculative_collapse_min_verify_steps=8,
)


@pytest.fixture(scope="module")
def models(make_model, tmp_path_factory):
    """Two targets with different weights (old, new), and a STANDALONE draft that is a copy of
    old (another directory, so a separate model with its own KV: it accepts every token until
    the target moves away from it)."""
    old = make_model("llama", num_layers=2, seed=1)
    new = make_model("llama", num_layers=2, seed=2)
    draft = str(tmp_path_factory.mktemp("alarm") / "draft")
    shutil.copytree(old, draft)
    return {"old": old, "new": new, "draft": draft}


def run(engine: Engine, prompts=PROMPTS, **kwargs) -> list[dict]:
    return engine.generate(input_ids=prompts, sampling_params=GREEDY, **kwargs)


def ids(outs: list[dict]) -> list[list[int]]:
    return [o["output_ids"] for o in outs]


def alarm_info(engine: Engine) -> dict:
    return engine.get_server_info()["internal_states"][0]["spec_accept_alarm"]


def plain_outputs(path: str, prompts=PROMPTS, params=GREEDY) -> list[list[int]]:
    with Engine(model_path=path, random_seed=0) as engine:
        return ids(engine.generate(input_ids=prompts, sampling_params=params))


# ------------------------------------------------------------ the alarm alone


def test_alarm_needs_a_sample_and_a_best_and_clears_on_update():
    alarm = AcceptAlarm(0.5, min_verify_steps=10, on_collapse="disable", version="v0")
    alarm.record(10, 10)  # the first weights: nothing to compare with
    assert not alarm.up
    alarm.weights_updated("v1")
    alarm.record(10, 40)  # 4.0 becomes the best once v1 is done
    alarm.weights_updated("v2")
    alarm.record(9, 9)  # 1.0, but 9 verify steps are too few to judge
    assert not alarm.up and alarm.speculating
    alarm.record(1, 1)
    assert alarm.up and not alarm.speculating
    report = alarm.report()
    assert report["best_accept_length"] == 4.0 and report["best_weight_version"] == "v1"
    assert report["accept_length_by_version"] == {"v0": 1.0, "v1": 4.0}
    alarm.relabel("v2b")
    alarm.weights_updated("v3")  # any update re-enables speculation and measures afresh
    assert not alarm.up and alarm.speculating and alarm.report()["verify_ct"] == 0
    alarm.record(10, 25)  # 2.5 >= 0.5 x 4.0
    assert not alarm.up
    assert alarm.report()["accept_length_by_version"]["v2b"] == 1.0


def test_warn_mode_clears_when_acceptance_recovers_under_the_same_weights():
    alarm = AcceptAlarm(0.5, min_verify_steps=4, on_collapse="warn", version="a")
    alarm.record(4, 16)
    alarm.weights_updated("b")
    alarm.record(4, 4)
    assert alarm.up and alarm.speculating  # warn: speculation goes on
    alarm.record(4, 16)  # (4 + 16) / 8 = 2.5 >= 2.0
    assert not alarm.up


# ------------------------------------------------------------ flags


def test_on_collapse_values_are_checked():
    with pytest.raises(ValueError, match="--speculative-on-collapse must be one of warn, disable"):
        EngineArgs(model_path="m", speculative_on_collapse="foo")
    for bad in (0.0, 1.0, 1.5):
        with pytest.raises(ValueError, match=f"must be in \\(0, 1\\).*got {bad}"):
            EngineArgs(model_path="m", speculative_collapse_threshold=bad)
    with pytest.raises(ValueError, match="--speculative-collapse-min-verify-steps must be"):
        EngineArgs(model_path="m", speculative_collapse_min_verify_steps=0)


def test_on_collapse_flag_refuses_foo_naming_the_choices(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--model-path", "m", "--speculative-on-collapse", "foo"])
    err = capsys.readouterr().err
    assert "invalid choice: 'foo'" in err and "'warn', 'disable'" in err


def test_train_py_takes_the_sglang_flags():
    args = parse_args(
        [
            "--hf-checkpoint",
            "m",
            "--rollout-batch-size",
            "1",
            "--num-rollout",
            "1",
            "--output-dir",
            "o",
            "--sglang-speculative-on-collapse",
            "disable",
            "--sglang-speculative-collapse-threshold",
            "0.7",
            "--sglang-speculative-collapse-min-verify-steps",
            "128",
        ]
    )
    engine = args.options.engine
    assert engine.speculative_on_collapse == "disable"
    assert engine.speculative_collapse_threshold == 0.7
    assert engine.speculative_collapse_min_verify_steps == 128


# ------------------------------------------------------------ engines


def test_warn_mode_raises_the_alarm_and_keeps_speculating(models, caplog):
    with Engine(
        model_path=models["old"],
        random_seed=0,
        speculative_draft_model_path=models["draft"],
        **STANDALONE,
    ) as engine:
        first = run(engine, return_logprob=True)
        assert all(o["meta_info"]["spec_accept_length"] > 3.5 for o in first)
        assert not any(o["meta_info"]["spec_accept_alarm"] for o in first)
        with caplog.at_level(logging.WARNING, logger="spec_engine.speculative.accept_alarm"):
            engine.update_weights_from_disk(models["new"], weight_version="step-1")
            outs = run(engine, return_logprob=True)
        lines = [r.getMessage() for r in caplog.records if "collapsed" in r.getMessage()]
        assert len(lines) == 1
        assert "'step-1'" in lines[0] and "'default'" in lines[0] and "0.50 x 4.00" in lines[0]
        info = alarm_info(engine)
        assert info["alarm"] and info["speculating"] and info["best_accept_length"] == 4.0
        assert info["accept_length"] < 2.0 and info["weight_version"] == "step-1"
        verify_ct = info["verify_ct"]
        again = run(engine)  # warn: speculation goes on
        assert alarm_info(engine)["verify_ct"] > verify_ct
    assert all(o["meta_info"]["spec_accept_alarm"] for o in again)
    assert ids(again) == ids(outs) == plain_outputs(models["new"])
    # The rollout side: the samples carry it, the rollout's metrics report it.
    samples = [fill_from_output(Sample(tokens=list(p)), o) for p, o in zip(PROMPTS, outs)]
    assert spec_metrics(samples)["rollout/spec_accept_alarm"] == 1.0
    before = [fill_from_output(Sample(tokens=list(p)), o) for p, o in zip(PROMPTS, first)]
    assert spec_metrics(before)["rollout/spec_accept_alarm"] == 0.0


def test_disable_mode_decodes_plainly_until_the_next_update(models):
    with Engine(
        model_path=models["old"],
        random_seed=0,
        speculative_draft_model_path=models["draft"],
        speculative_on_collapse="disable",
        **STANDALONE,
    ) as engine:
        run(engine)
        engine.update_weights_from_disk(models["new"], weight_version="step-1")
        collapsed = run(engine)  # fires after 8 verify steps; the rest of the batch runs plainly
        info = alarm_info(engine)
        assert info["alarm"] and not info["speculating"] and info["verify_ct"] == 8
        plain = run(engine, return_logprob=True)
        assert [o["meta_info"]["spec_verify_ct"] for o in plain] == [0] * len(PROMPTS)
        assert alarm_info(engine)["verify_ct"] == 8  # no verify step under the alarm
        assert all(o["meta_info"]["spec_accept_alarm"] for o in plain)
        # The draft catches up (an update of the draft alone): speculation resumes.
        engine.update_weights_from_disk(models["new"], component="draft", weight_version="step-2")
        resumed = run(engine)
        info = alarm_info(engine)
    assert not info["alarm"] and info["speculating"] and info["accept_length"] > 3.5
    assert info["accept_length_by_version"] == {"default": 4.0, "step-1": 1.0}
    assert all(o["meta_info"]["spec_verify_ct"] > 0 for o in resumed)
    assert not any(o["meta_info"]["spec_accept_alarm"] for o in resumed)
    expected = plain_outputs(models["new"])
    assert ids(collapsed) == ids(plain) == ids(resumed) == expected
    samples = [fill_from_output(Sample(tokens=list(p)), o) for p, o in zip(PROMPTS, plain)]
    metrics = spec_metrics(samples)  # a rollout without one verify step still reports it
    assert metrics == {"rollout/spec_accept_alarm": 1.0}


@pytest.fixture(scope="module")
def feature_drafts(make_model, tmp_path_factory):
    target = make_model("llama", num_layers=2, seed=1)
    eagle = build_eagle_draft(str(tmp_path_factory.mktemp("alarm_eagle")), target, version=2)
    mimo = add_mimo_mtp(make_model("qwen2", num_layers=2, seed=3), seed=4)
    return {
        "eagle": (
            target,
            dict(
                speculative_draft_model_path=eagle,
                speculative_eagle_topk=2,
                speculative_num_draft_tokens=6,
            ),
        ),
        "mtp": (mimo, dict(speculative_eagle_topk=1)),
    }


@pytest.mark.parametrize("kind", ["eagle", "mtp"])
def test_switching_mid_request_stays_lossless(feature_drafts, kind):
    """Requests that decoded plainly under the alarm keep decoding plainly after the update
    (their draft KV and state lag), while requests admitted after it speculate, in the same
    steps; every output equals plain decoding. The alarm is forced (random tiny drafts accept
    too little to show a collapse) while requests are in flight."""
    path, draft = feature_drafts[kind]
    first, second = random_prompts(3, 4, 16, seed=41), random_prompts(3, 4, 16, seed=42)
    params = {**GREEDY, "max_new_tokens": 40}
    with Engine(
        model_path=path,
        random_seed=0,
        speculative_algorithm="EAGLE",
        speculative_num_steps=3,
        speculative_on_collapse="disable",
        **draft,
    ) as engine:
        stream_a = engine.generate(input_ids=first, sampling_params=params, stream=True)
        next(stream_a)  # prefilled and decoding
        engine.pause_generation(mode="in_place")

        def force() -> list[int]:
            engine.scheduler.policy.alarm.up = True
            return [r.spec_verify_ct for r in engine.scheduler.running]

        verified_before = engine._call(force)
        assert len(verified_before) == len(first)
        engine.continue_generation()

        def all_stale() -> bool:  # every request runs and has taken a plain step
            running = engine.scheduler.running
            return len(running) == len(first) and all(r.draft_stale for r in running)

        while not engine._call(all_stale):
            next(stream_a)
        engine.pause_generation(mode="in_place")
        assert len(engine._call(lambda: engine.scheduler.running)) == len(first)
        engine.update_weights_from_disk(path, weight_version="same-weights")
        stream_b = engine.generate(input_ids=second, sampling_params=params, stream=True)
        engine.continue_generation()
        outs_b = list(stream_b)
        outs_a = list(stream_a)
    final_a = sorted(
        (o for o in outs_a if o["meta_info"]["finish_reason"]), key=lambda o: o["index"]
    )
    final_b = sorted(
        (o for o in outs_b if o["meta_info"]["finish_reason"]), key=lambda o: o["index"]
    )
    assert len(final_a) == len(first) and len(final_b) == len(second)
    # The first batch never verified again after the alarm; the second speculated.
    assert sorted(o["meta_info"]["spec_verify_ct"] for o in final_a) == sorted(verified_before)
    assert all(o["meta_info"]["spec_verify_ct"] > 0 for o in final_b)
    assert ids(final_a) + ids(final_b) == plain_outputs(path, first + second, params)


def test_retracted_plain_requests_speculate_again_after_the_update(feature_drafts):
    """slime's pause(retract) around an update: requests that decoded plainly under the alarm
    are prefilled again (draft KV and state rebuilt), so they speculate on the new weights."""
    path, draft = feature_drafts["eagle"]
    prompts = random_prompts(4, 4, 16, seed=43)
    params = {**GREEDY, "max_new_tokens": 40}
    with Engine(
        model_path=path,
        random_seed=0,
        speculative_algorithm="EAGLE",
        speculative_num_steps=3,
        speculative_on_collapse="disable",
        **draft,
    ) as engine:
        engine._call(lambda: setattr(engine.scheduler.policy.alarm, "up", True))
        stream = engine.generate(input_ids=prompts, sampling_params=params, stream=True)

        def all_stale() -> bool:  # every request runs and has taken a plain step
            running = engine.scheduler.running
            return len(running) == len(prompts) and all(r.draft_stale for r in running)

        while not engine._call(all_stale):
            next(stream)
        engine.pause_generation(mode="retract")
        waiting = engine._call(lambda: list(engine.scheduler.admission.waiting))
        assert len(waiting) == len(prompts) and all(r.draft_stale for r in waiting)
        engine.update_weights_from_disk(path, weight_version="same-weights")
        engine.continue_generation()
        outs = sorted(
            (o for o in stream if o["meta_info"]["finish_reason"]), key=lambda o: o["index"]
        )
    assert all(o["meta_info"]["spec_verify_ct"] > 0 for o in outs)
    assert ids(outs) == plain_outputs(path, prompts, params)
