"""A run's line per rollout, its closing summary and its plots, from a metrics.jsonl."""

from __future__ import annotations

import os

from rollout.metrics import MetricsLogger
from specrl.plots import read_series, write_run_plots
from specrl.summary import rollout_line, summarize

ROWS = [
    {
        "rollout/raw_reward": 0.125,
        "rollout/spec_accept_length": 2.5,
        "perf/rollout_time": 1.0,
        "perf/actor_train_time": 2.0,
        "perf/update_weights_time": 0.25,
        "perf/step_time": 3.5,
    },
    {
        "rollout/raw_reward": 0.5,
        "rollout/spec_accept_length": 2.75,
        "perf/rollout_time": 1.5,
        "perf/actor_train_time": 2.5,
        "perf/update_weights_time": 0.25,
        "perf/step_time": 4.5,
    },
    {
        "rollout/raw_reward": 0.875,
        "rollout/spec_accept_length": 3.0,
        "perf/rollout_time": 0.5,
        "perf/actor_train_time": 1.5,
        "perf/update_weights_time": 0.5,
        "perf/step_time": 2.5,
    },
]


def log_run(out: str, rows: list[dict[str, float]]) -> str:
    with MetricsLogger(out) as log:
        for step, row in enumerate(rows):
            log.log(step, row)
        return log.path


def test_summary_and_plots_of_a_run(tmp_path):
    out = str(tmp_path / "run")
    path = log_run(out, ROWS)
    plots = write_run_plots(path, os.path.join(out, "plots"))
    assert plots == [
        os.path.join(out, "plots", "reward.svg"),
        os.path.join(out, "plots", "accept_length.svg"),
    ]
    for plot in plots:
        text = open(plot).read()
        assert text.startswith("<svg") and text.count("<polyline") == 2  # axes and the run
    summary = summarize(path, plots).splitlines()
    assert summary == [
        "run summary (3 rollouts)",
        "  reward:         0.125 -> 0.875 (first -> last rollout)",
        "  accept length:  2.50 -> 3.00 (first -> last rollout)",
        "  total time:     rollout 3.0 s, train 6.0 s, weight update 1.0 s",
        f"  metrics:        {path}",
        f"  plots:          {plots[0]}, {plots[1]}",
    ]


def test_summary_without_speculation_or_training(tmp_path):
    rows = [{"rollout/raw_reward": r, "perf/rollout_time": 1.0} for r in (0.0, 0.25)]
    path = log_run(str(tmp_path), rows)
    plots = write_run_plots(path, str(tmp_path / "plots"))
    assert [os.path.basename(p) for p in plots] == ["reward.svg"]  # no accept length to plot
    summary = summarize(path, plots)
    assert "accept length:  not logged (no rollout/spec_accept_length)" in summary
    assert "total time:     rollout 2.0 s\n" in summary
    assert read_series(path, "rollout/raw_reward") == [(0, 0.0), (1, 0.25)]


def test_rollout_line_is_short():
    line = rollout_line(2, 30, {**ROWS[0], "train/loss": 0.1, "rollout/response_len/mean": 4.0})
    assert line == (
        "rollout 3/30: reward 0.125, accept length 2.50 | 3.50 s (rollout 1.00 s, "
        "train 2.00 s, weight update 0.25 s)"
    )
    assert rollout_line(0, 1, {"rollout/raw_reward": 1.0}) == "rollout 1/1: reward 1.000"
