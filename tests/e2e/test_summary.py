"""A run's line per rollout, its closing summary and its plots, from a metrics.jsonl."""

from __future__ import annotations

import os

from rollout.metrics import MetricsLogger
from specrl.plots import BATCH_SIZE_SERIES, read_series, write_run_plots
from specrl.summary import rollout_line, summarize

ROWS = [
    {
        "rollout/raw_reward": 0.125,
        "rollout/spec_accept_length": 2.5,
        "perf/rollout_time": 1.0,
        "perf/rollout_tail_time": 0.5,
        "perf/actor_train_time": 2.0,
        "perf/update_weights_time": 0.25,
        "perf/step_time": 3.5,
    },
    {
        "rollout/raw_reward": 0.5,
        "rollout/spec_accept_length": 2.75,
        "perf/rollout_time": 1.5,
        "perf/rollout_tail_time": 0.75,
        "perf/actor_train_time": 2.5,
        "perf/update_weights_time": 0.25,
        "perf/step_time": 4.5,
    },
    {
        "rollout/raw_reward": 0.875,
        "rollout/spec_accept_length": 3.0,
        "perf/rollout_time": 0.5,
        "perf/rollout_tail_time": 0.25,
        "perf/actor_train_time": 1.5,
        "perf/update_weights_time": 0.5,
        "perf/step_time": 2.5,
    },
]


# The engines' running requests over each rollout: two engines; None, one that did not answer.
BATCH_SIZES = [
    {"time": [0.1, 0.2, 0.3], "running_reqs": [[4, None], [3, 1], [1, 0]]},
    {"time": [0.1], "running_reqs": [[2, 2]]},
    {"time": [0.1, 0.2], "running_reqs": [[1, 1], [0, 1]]},
]


def log_run(out: str, rows: list[dict[str, float]], series: list[dict] = ()) -> str:
    with MetricsLogger(out) as log:
        for step, row in enumerate(rows):
            log.log(step, row)
        for step, trace in enumerate(series):
            log.log_series(step, BATCH_SIZE_SERIES, trace)
        return log.path


def test_summary_and_plots_of_a_run(tmp_path):
    out = str(tmp_path / "run")
    path = log_run(out, ROWS, BATCH_SIZES)
    plots = write_run_plots(path, os.path.join(out, "plots"))
    names = ["reward", "accept_length", "tail_time", "engine_batch_size"]
    assert plots == [os.path.join(out, "plots", f"{name}.svg") for name in names]
    for plot in plots[:3]:
        text = open(plot).read()
        assert text.startswith("<svg") and text.count("<polyline") == 2  # axes and the run
    # The batch size over the first, middle and last rollouts: per poll, the mean of the engines
    # that answered (rollout 0: 4, 2, 0.5; the axis tops out at 4 * 1.1).
    text = open(plots[3]).read()
    assert text.count("<polyline") == 4 and ">4.40</text>" in text
    assert all(f">rollout {i}</text>" in text for i in range(3))
    assert "seconds into the rollout" in text
    summary = summarize(path, plots).splitlines()
    assert summary == [
        "run summary (3 rollouts)",
        "  reward:         0.125 -> 0.875 (first -> last rollout)",
        "  accept length:  2.50 -> 3.00 (first -> last rollout)",
        "  total time:     rollout 3.0 s, train 6.0 s, weight update 1.0 s",
        f"  metrics:        {path}",
        f"  plots:          {', '.join(plots)}",
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
