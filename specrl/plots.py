"""Metrics of runs (their metrics.jsonl) as SVG line charts, one metric per chart, with no
plotting library."""

from __future__ import annotations

import json
import os

COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf")
WIDTH, HEIGHT, PAD = 640, 360, 48
# What every run plots: the reward and the speculative accept length per rollout.
RUN_PLOTS = {
    "rollout/raw_reward": "reward.svg",
    "rollout/spec_accept_length": "accept_length.svg",
    "perf/rollout_tail_time": "tail_time.svg",
}
# The engines' running requests over each rollout (rollout.engine_load.BatchSizeTrace), saved
# next to metrics.jsonl as {BATCH_SIZE_SERIES}.jsonl and plotted against the seconds into the
# rollout for its first, middle and last rollouts.
BATCH_SIZE_SERIES = "engine_batch_size"

Series = list[tuple[int, float]]


def read_metrics(path: str) -> list[dict[str, float | None]]:
    """The rows of a metrics.jsonl, one per rollout in rollout order. The file is only ever
    appended to, so a run resumed from a checkpoint logs the rollouts after it again: the last
    line of each rollout is the one that counts."""
    rows: dict[int, dict[str, float | None]] = {}
    with open(path) as f:
        for line in f:
            if line.strip():
                row = json.loads(line)
                rows[row.get("rollout_id", row["step"])] = row
    return [rows[k] for k in sorted(rows)]


def read_series(path: str, metric: str) -> Series:
    """(step, value) of `metric` in a metrics.jsonl, skipping steps without it."""
    return [(r["step"], r[metric]) for r in read_metrics(path) if r.get(metric) is not None]


def svg(series: dict[str, Series], metric: str, x_label: str = "rollout") -> str:
    """A line chart of `metric`, one line per named series."""
    points = [p for s in series.values() for p in s]
    if not points:
        raise ValueError(f"no values of {metric!r} in the given runs")
    x_max = max(x for x, _ in points) or 1
    y_lo, y_hi = min(0.0, min(y for _, y in points)), max(y for _, y in points) * 1.1 or 1.0

    def at(x: float, y: float) -> str:
        px = PAD + x / x_max * (WIDTH - 2 * PAD)
        py = HEIGHT - PAD - (y - y_lo) / (y_hi - y_lo) * (HEIGHT - 2 * PAD)
        return f"{px:.1f},{py:.1f}"

    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" '
        'font-family="sans-serif" font-size="12">',
        f'<rect width="{WIDTH}" height="{HEIGHT}" fill="white"/>',
        f'<polyline points="{at(0, y_hi)} {at(0, y_lo)} {at(x_max, y_lo)}" fill="none" '
        'stroke="black"/>',
        f'<text x="{WIDTH / 2}" y="{HEIGHT - 10}" text-anchor="middle">{x_label}</text>',
        f'<text x="{PAD}" y="20">{metric}</text>',
    ]
    for frac in (0.0, 0.5, 1.0):
        y = y_lo + frac * (y_hi - y_lo)
        x0, y0 = at(0, y).split(",")
        parts.append(f'<text x="{float(x0) - 6}" y="{y0}" text-anchor="end">{y:.2f}</text>')
    for i, (name, pts) in enumerate(series.items()):
        color = COLORS[i % len(COLORS)]
        line = " ".join(at(x, y) for x, y in pts)
        parts.append(f'<polyline points="{line}" fill="none" stroke="{color}" stroke-width="2"/>')
        parts.append(
            f'<text x="{WIDTH - PAD - 100}" y="{40 + 16 * i}" fill="{color}">{name}</text>'
        )
    parts.append("</svg>")
    return "\n".join(parts)


def write_run_plots(metrics_path: str, out_dir: str) -> list[str]:
    """The RUN_PLOTS of one run written under `out_dir`; returns their paths (a metric the run
    never logged, such as the accept length without speculative decoding, has no plot)."""
    os.makedirs(out_dir, exist_ok=True)
    run = os.path.basename(os.path.dirname(os.path.abspath(metrics_path)))
    written = []
    for metric, name in RUN_PLOTS.items():
        series = read_series(metrics_path, metric)
        if series:
            path = os.path.join(out_dir, name)
            with open(path, "w") as f:
                f.write(svg({run: series}, metric))
            written.append(path)
    series_path = os.path.join(os.path.dirname(metrics_path), f"{BATCH_SIZE_SERIES}.jsonl")
    if os.path.exists(series_path):
        path = os.path.join(out_dir, f"{BATCH_SIZE_SERIES}.svg")
        with open(path, "w") as f:
            f.write(batch_size_svg(read_metrics(series_path)))
        written.append(path)
    return written


def batch_size_svg(rollouts: list[dict]) -> str:
    """The running requests of an engine (the mean over the engines that answered a poll)
    against the seconds into the rollout, for the first, middle and last of `rollouts`."""
    picked = {r["rollout_id"]: r for r in (rollouts[0], rollouts[len(rollouts) // 2], rollouts[-1])}
    series = {}
    for rollout_id, r in sorted(picked.items()):
        points = []
        for t, counts in zip(r["time"], r["running_reqs"]):
            answered = [n for n in counts if n is not None]
            points.append((t, sum(answered) / len(answered)))
        series[f"rollout {rollout_id}"] = points
    return svg(series, "engine batch size (running requests)", x_label="seconds into the rollout")
