"""--speculative-adaptive: per decode step, speculate or decode plainly from the batch size and
a measured cost model (NGRAM); outputs equal plain decoding either way."""

from __future__ import annotations

import pytest

from spec_engine import Engine
from spec_engine.args.engine_args import EngineArgs
from spec_engine.core.adaptive import EXPLORE_EVERY, WARM_STEPS, SpecCostModel, bucket
from spec_engine.launch_server import build_parser
from specrl.train_options import parse_args
from tests.conftest import random_prompts

GREEDY = {"temperature": 0.0, "max_new_tokens": 24, "ignore_eos": True}
NGRAM = dict(speculative_algorithm="NGRAM", speculative_num_draft_tokens=6)


def repetitive(count: int, seed: int) -> list[list[int]]:
    """Prompts that repeat a short pattern, so NGRAM drafts get accepted."""
    return [p * 5 for p in random_prompts(count, 4, 8, seed=seed)]


# ------------------------------------------------------------ the cost model alone


def test_buckets_are_powers_of_two():
    assert [bucket(b) for b in (1, 2, 3, 4, 5, 8, 9, 64, 65)] == [1, 2, 4, 4, 8, 8, 16, 64, 128]


def test_cost_model_warms_up_both_modes_then_picks_the_faster_and_explores():
    model = SpecCostModel()
    seen = []
    for _ in range(2 * (WARM_STEPS + 1)):  # the first step of each mode is not counted
        mode = model.speculate(32)
        seen.append(mode)
        # Speculating costs 5x a plain step per request and emits 2 tokens: plain is faster.
        model.observe(mode, 32, 32 * (5.0 if mode else 1.0), verify_ct=32, emitted=64)
    assert seen == [True] * (WARM_STEPS + 1) + [False] * (WARM_STEPS + 1)
    assert model.expected_speculative_gain(32) == pytest.approx(0.4)
    steps = []
    for _ in range(2 * EXPLORE_EVERY):
        mode = model.speculate(30)  # same bucket as 32
        steps.append(mode)
        model.observe(mode, 30, 30 * (5.0 if mode else 1.0), verify_ct=30, emitted=60)
    assert steps.count(True) == 2 and not steps[0]  # one try of speculation per EXPLORE_EVERY
    # Batch 1 is measured on its own: there speculation is cheap and wins.
    for _ in range(2 * (WARM_STEPS + 1)):
        mode = model.speculate(1)
        model.observe(mode, 1, 1.2 if mode else 1.0, verify_ct=1, emitted=2)
    assert model.speculate(1) and not model.speculate(20)
    report = model.report()
    assert report["buckets"][1]["speculate"] and not report["buckets"][32]["speculate"]
    assert report["plain_steps"] > report["speculative_steps"] > 0


def test_set_costs_freezes_the_model():
    model = SpecCostModel()
    model.set_costs(4, plain_s=1.0, spec_s=3.0, accept_length=2.0)
    assert not model.speculate(3)
    model.observe(False, 4, 100.0)  # counted as a decision, but does not move the averages
    assert model.report()["buckets"][4]["plain_s_per_req"] == 1.0
    assert model.report()["plain_steps"] == 1
    assert not model.speculate(1)  # frozen: no warm-up tries; unmeasured means no gain known


# ------------------------------------------------------------ flags


def test_adaptive_needs_an_algorithm_and_takes_any():
    with pytest.raises(ValueError, match="--speculative-adaptive needs --speculative-algorithm"):
        EngineArgs(model_path="m", speculative_adaptive=True)
    for algo in ("EAGLE", "EAGLE3", "STANDALONE", "NEXTN", "ngram"):
        args = EngineArgs(model_path="m", speculative_algorithm=algo, speculative_adaptive=True)
        assert args.speculative_adaptive


def test_flag_on_the_server_and_in_train_py():
    ns = build_parser().parse_args(
        ["--model-path", "m", "--speculative-algorithm", "NGRAM", "--speculative-adaptive"]
    )
    assert ns.speculative_adaptive is True
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
            "--sglang-speculative-algorithm",
            "NGRAM",
            "--sglang-speculative-adaptive",
        ]
    )
    assert args.options.engine.speculative_adaptive is True


# ------------------------------------------------------------ engines


@pytest.fixture(scope="module")
def target(make_model):
    return make_model("llama", num_layers=2, seed=1)


def plain_outputs(path: str, prompts, params) -> list[list[int]]:
    with Engine(model_path=path, random_seed=0) as engine:
        outs = engine.generate(input_ids=prompts, sampling_params=params)
    return [o["output_ids"] for o in outs]


def test_speculates_at_batch_1_and_decodes_plainly_at_a_large_batch(target):
    """Costs injected: speculation wins up to batch 2 and loses from 3 on. A batch of 1
    speculates; a batch of 8 never verifies; a batch that shrinks from 4 to 1 (different
    lengths) switches mid-request. Every output equals plain decoding."""
    one, eight = repetitive(1, seed=50), repetitive(8, seed=51)
    shrinking = repetitive(4, seed=52)
    lengths = [{**GREEDY, "max_new_tokens": n} for n in (4, 8, 30, 40)]
    with Engine(model_path=target, random_seed=0, speculative_adaptive=True, **NGRAM) as engine:

        def inject() -> None:
            model = engine.scheduler.adaptive
            for b in (1, 2):
                model.set_costs(b, plain_s=1.0, spec_s=1.5, accept_length=2.0)  # gain 1.33
            for b in (4, 8, 16):
                model.set_costs(b, plain_s=1.0, spec_s=4.0, accept_length=2.0)  # gain 0.5

        engine._call(inject)
        out_one = engine.generate(input_ids=one, sampling_params=GREEDY)
        out_eight = engine.generate(input_ids=eight, sampling_params=GREEDY)
        out_shrink = engine.generate(input_ids=shrinking, sampling_params=lengths)
        report = engine.get_server_info()["internal_states"][0]["spec_adaptive"]
    assert out_one[0]["meta_info"]["spec_verify_ct"] > 0
    assert out_one[0]["meta_info"]["spec_accept_length"] > 1.0
    assert [o["meta_info"]["spec_verify_ct"] for o in out_eight] == [0] * 8
    verified = [o["meta_info"]["spec_verify_ct"] for o in out_shrink]
    # The first two ran only at batch >= 3 (plain); the others decoded their first tokens plainly
    # beside them, then speculated once the batch was down to 2.
    assert verified[:2] == [0, 0] and verified[2] > 0 and verified[3] > 0
    assert report["speculative_steps"] > 0 and report["plain_steps"] > 0
    assert [o["output_ids"] for o in out_one] == plain_outputs(target, one, GREEDY)
    assert [o["output_ids"] for o in out_eight] == plain_outputs(target, eight, GREEDY)
    assert [o["output_ids"] for o in out_shrink] == plain_outputs(target, shrinking, lengths)


def test_measured_online_outputs_equal_plain_decoding(target):
    """The cost model left to measure (warm-up tries of both modes in every bucket the batch
    passes through, then its own choices): outputs still equal plain decoding, log-probs too."""
    prompts = repetitive(6, seed=53)
    params = [{**GREEDY, "max_new_tokens": n} for n in (6, 12, 18, 24, 30, 36)]
    with Engine(model_path=target, random_seed=0, speculative_adaptive=True, **NGRAM) as engine:
        outs = engine.generate(input_ids=prompts, sampling_params=params, return_logprob=True)
        report = engine.get_server_info()["internal_states"][0]["spec_adaptive"]
    with Engine(model_path=target, random_seed=0) as engine:
        plain = engine.generate(input_ids=prompts, sampling_params=params, return_logprob=True)
    assert report["speculative_steps"] > 0 and report["plain_steps"] > 0
    assert [o["output_ids"] for o in outs] == [o["output_ids"] for o in plain]
    for o, p in zip(outs, plain):
        got = [lp for lp, _, _ in o["meta_info"]["output_token_logprobs"]]
        want = [lp for lp, _, _ in p["meta_info"]["output_token_logprobs"]]
        assert got == pytest.approx(want, abs=1e-4)
