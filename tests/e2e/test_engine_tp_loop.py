"""scripts/train.py with engines of two devices (--rollout-num-gpus 2 --rollout-num-gpus-per-engine
2 on CPU: one engine, a Ray actor whose engine spawns its second tensor-parallel rank), colocated
with the trainer: its rollout 0 equals the tp-1 engine's (the shared --debug-rollout-only run of
tests/conftest.py, same seeds), every push lands on both ranks (--check-weight-update-equal
compares the checksums gathered from the ranks with the trainer's tensors), and a killed rank 1
is a dead engine that --use-fault-tolerance restarts whole, with the policy's weights."""

from __future__ import annotations

import json
import os

import pytest

from rollout.debug_data import load_debug_rollout_data
from tests.e2e.test_train_loop import base_args, run

pytest.importorskip("ray")


@pytest.mark.slow
def test_a_two_device_engine_rolls_out_as_tp_1_takes_every_push_and_restarts_whole(
    rl_task, rollout_only_run, tmp_path
):
    model, data = rl_task
    out = str(tmp_path / "run")
    saved = os.path.join(out, "rollouts", "{rollout_id}.pt")
    argv = base_args(model, data, out) + [
        "--rollout-num-gpus",
        "2",
        "--rollout-num-gpus-per-engine",
        "2",
        "--colocate",
        "--lr",
        "1e-3",
        "--check-weight-update-equal",
        "--use-fault-tolerance",
        "--custom-generate-function-path",
        "tests.support.engine_killer.generate_then_kill_rank_1",
        "--save-debug-rollout-data",
        saved,
    ]
    proc = run(argv)
    assert "starting 1 engine(s) and 1 trainer rank(s)" in proc.stdout + proc.stderr
    with open(os.path.join(out, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    assert [r["rollout/weight_version"] for r in rows] == [0, 1]
    # Rollout 1: rank 1 killed mid-request; the engine (both ranks) restarted and its requests
    # redone, the restarted engine given version 1 (the push is checked like every other).
    assert [r["rollout/engine_restarts"] for r in rows] == [0, 1]
    assert rows[1]["rollout/requests_redone"] >= 1
    assert "tensor-parallel rank 1 (pid" in proc.stderr, proc.stderr[-3000:]
    assert "engine 0 died (" in proc.stderr and "engine 0 restarted in" in proc.stderr
    # Rollout 0, from --hf-checkpoint's weights: the tokens the tp-1 engine sampled with the same
    # seeds (ties aside: none here), log-probs within float32 rounding of a split reduction.
    _, tp1_out = rollout_only_run
    # Samples by index (each index has its prompt and sampling seed); groups come in the order
    # they finished.
    ours, theirs = (
        {s.index: s for group in load_debug_rollout_data(path, 0) for s in group}
        for path in (saved, os.path.join(tp1_out, "rollouts", "{rollout_id}.pt"))
    )
    assert sorted(ours) == sorted(theirs) == list(range(8))
    for i, a in ours.items():
        assert a.tokens == theirs[i].tokens, i
        assert a.rollout_log_probs == pytest.approx(theirs[i].rollout_log_probs, abs=1e-4)


@pytest.mark.parametrize(
    "flags,needle",
    [
        (
            ["--rollout-num-gpus", "3", "--rollout-num-gpus-per-engine", "2"],
            "--rollout-num-gpus 3 must be a positive multiple of --rollout-num-gpus-per-engine 2",
        ),
        (  # the model has 4 attention heads
            ["--rollout-num-gpus", "3", "--rollout-num-gpus-per-engine", "3"],
            r"--rollout-num-gpus-per-engine 3 runs each engine at --tp-size 3 .*: "
            r"num_attention_heads \(4\) is not divisible by --tp-size 3",
        ),
    ],
)
def test_engine_sizes_the_engines_cannot_run_are_refused(flags, needle, rl_task, tmp_path):
    from specrl.train_options import check_checkpoints, parse_args

    model, data = rl_task
    argv = base_args(model, data, str(tmp_path)) + flags
    with pytest.raises(SystemExit, match=needle):
        check_checkpoints(parse_args(argv))
