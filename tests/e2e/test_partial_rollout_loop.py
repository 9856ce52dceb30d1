"""scripts/train.py with --partial-rollout and --mask-offpolicy-in-partial-rollout on CPU: the
groups left over by a rollout are continued in the next one under the weights the trainer just
pushed, their earlier tokens masked, and every group is trained once."""

from __future__ import annotations

import os

import pytest

from rollout.debug_data import load_debug_rollout_data
from specrl.plots import read_metrics
from tests.e2e.test_train_loop import base_args, metrics

pytest.importorskip("ray")

NUM_ROLLOUT = 3


def partial_args(model: str, data: str, out: str, saved: str) -> list[str]:
    """--partial-rollout with six groups in flight for two kept; stopping on a tenth of the
    vocabulary spreads the response lengths, so the abort cuts the groups not needed half-way.
    (tests/conftest.py's partial_rollout_run adds --ref-load to it.)"""
    argv = base_args(model, data, out) + [
        "--partial-rollout",
        "--mask-offpolicy-in-partial-rollout",
    ]
    argv += ["--over-sampling-batch-size", "6", "--rollout-stop-token-ids"]
    argv += [str(t) for t in range(100, 150)]
    argv += ["--save-debug-rollout-data", saved, "--lr", "1e-3"]
    argv[argv.index("--rollout-max-response-len") + 1] = "24"
    argv[argv.index("--num-rollout") + 1] = str(NUM_ROLLOUT)
    return argv


def test_the_loop_continues_left_over_groups_under_the_new_weights(partial_rollout_run):
    out, saved = partial_rollout_run
    rows = metrics(out)
    rollouts = [load_debug_rollout_data(saved, i) for i in range(NUM_ROLLOUT)]
    continued = 0
    for rollout_id, (row, groups) in enumerate(zip(rows, rollouts)):
        assert row["rollout/weight_version"] == rollout_id and "train/loss" in row
        samples = [s for g in groups for s in g]
        begun_earlier = [s for s in samples if "start_rollout_id" in s.metadata]
        assert row["rollout/partial_samples_ratio"] == len(begun_earlier) / len(samples)
        # the masked tokens of older weights are not trained: none is stale
        trained = sum(sum(s.loss_mask) for s in samples)
        lag = row.get("rollout/weight_version_lag/max")
        assert lag == (0.0 if trained else None) == row.get("rollout/weight_version_lag/mean")
        for s in samples:
            versions = s.token_weight_versions
            assert len(versions) == s.response_length <= 24
            # the engines label each push with the rollout it generates: only its tokens train
            assert s.loss_mask == [int(v == str(rollout_id)) for v in versions]
            # one request per rollout it was generated in, each under that rollout's weights
            assert s.weight_versions == sorted(set(s.weight_versions), key=int)
            assert set(versions) <= set(s.weight_versions)
            continued += str(rollout_id) in versions and versions[0] != str(rollout_id)
    assert continued > 0, "no response was continued under new weights; the test proves nothing"
    # The engine's running requests, polled through its Ray actor: at most the 6 groups of 4
    # in flight; saved per rollout next to metrics.jsonl, and plotted.
    polled = read_metrics(os.path.join(out, "engine_batch_size.jsonl"))
    assert polled, "no rollout lasted a poll; the test proves nothing"
    for trace in polled:
        counts = [n for [n] in trace["running_reqs"]]
        assert rows[trace["rollout_id"]]["perf/engine_batch_size/max"] == max(counts) <= 24
    assert max(n for trace in polled for [n] in trace["running_reqs"]) > 0, polled
    assert os.path.exists(os.path.join(out, "plots", "engine_batch_size.svg"))
    trained = [g[0].group_index for groups in rollouts for g in groups]
    assert len(trained) == len(set(trained)) == 2 * NUM_ROLLOUT
