"""What a run reports on stdout: a compact line per rollout while it runs (metrics.jsonl has
every metric), and a closing summary read back from metrics.jsonl."""

from __future__ import annotations

from specrl.plots import read_metrics

# (label, metric, format) of the numbers a rollout's line and the summary show.
REWARD = ("reward", "rollout/raw_reward", "{:.3f}")
ACCEPT_LENGTH = ("accept length", "rollout/spec_accept_length", "{:.2f}")
# (label, metric) of the time spent per rollout, summed in the summary.
TIMES = (
    ("rollout", "perf/rollout_time"),
    ("train", "perf/actor_train_time"),
    ("weight update", "perf/update_weights_time"),
)


def rollout_line(rollout_id: int, num_rollout: int, metrics: dict[str, float]) -> str:
    """e.g. `rollout 3/30: reward 0.125, accept length 2.61 | 0.19 s (rollout 0.10 s, train
    0.05 s, weight update 0.03 s)`; absent metrics are left out."""
    numbers = [
        f"{label} {fmt.format(metrics[key])}"
        for label, key, fmt in (REWARD, ACCEPT_LENGTH)
        if metrics.get(key) is not None
    ]
    times = [f"{label} {metrics[key]:.2f} s" for label, key in TIMES if key in metrics]
    line = f"rollout {rollout_id + 1}/{num_rollout}: {', '.join(numbers)}"
    if "perf/step_time" in metrics:
        line += f" | {metrics['perf/step_time']:.2f} s"
    return line + (f" ({', '.join(times)})" if times else "")


def summarize(metrics_path: str, plots: list[str]) -> str:
    """The closing summary: reward and accept length first -> last rollout, total times, and
    where the metrics and plots are."""
    rows = read_metrics(metrics_path)
    lines = [f"run summary ({len(rows)} rollouts)"]
    for label, key, fmt in (REWARD, ACCEPT_LENGTH):
        values = [r[key] for r in rows if r.get(key) is not None]
        change = (
            f"{fmt.format(values[0])} -> {fmt.format(values[-1])} (first -> last rollout)"
            if values
            else f"not logged (no {key})"
        )
        lines.append(f"  {label + ':':<16}{change}")
    totals = [
        f"{label} {sum(r[key] for r in rows if r.get(key) is not None):.1f} s"
        for label, key in TIMES
        if any(r.get(key) is not None for r in rows)
    ]
    lines.append(f"  {'total time:':<16}{', '.join(totals) or 'none logged'}")
    lines.append(f"  {'metrics:':<16}{metrics_path}")
    lines.append(f"  {'plots:':<16}{', '.join(plots) or 'none (nothing to plot)'}")
    return "\n".join(lines)
