"""Metrics of runs (their metrics.jsonl) as SVG line charts, one metric per chart, with no
plotting library."""

from __future__ import annotations

import json
import os

COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf")
WIDTH, HEIGHT, PAD = 640, 360, 48
# What every run plots: the reward and the speculative accept length per rollout.
RUN_PLOTS = {"rollout/raw_reward": "reward.svg", "rollout/spec_accept_length": "accept_length.svg"}

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
    return written
