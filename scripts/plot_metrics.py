"""Plot one metric of several runs' metrics.jsonl as an SVG line chart (no plotting library needed).

    python -m scripts.plot_metrics --metric rollout/spec_accept_length --out plot.svg \\
        online=runs/a/metrics.jsonl frozen=runs/b/metrics.jsonl
"""

from __future__ import annotations

import argparse
import json

COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd")
WIDTH, HEIGHT, PAD = 640, 360, 48


def read_series(path: str, metric: str) -> list[tuple[int, float]]:
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [(r["step"], r[metric]) for r in rows if r.get(metric) is not None]


def svg(series: dict[str, list[tuple[int, float]]], metric: str) -> str:
    points = [p for s in series.values() for p in s]
    if not points:
        raise ValueError(f"no values of {metric!r} in the given runs")
    x_max = max(x for x, _ in points) or 1
    y_lo, y_hi = min(0.0, min(y for _, y in points)), max(y for _, y in points) * 1.1 or 1.0

    def at(x: float, y: float) -> str:
        return f"{PAD + x / x_max * (WIDTH - 2 * PAD):.1f},{HEIGHT - PAD - (y - y_lo) / (y_hi - y_lo) * (HEIGHT - 2 * PAD):.1f}"

    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" font-family="sans-serif" font-size="12">',
             f'<rect width="{WIDTH}" height="{HEIGHT}" fill="white"/>',
             f'<polyline points="{at(0, y_hi)} {at(0, y_lo)} {at(x_max, y_lo)}" fill="none" stroke="black"/>',
             f'<text x="{WIDTH / 2}" y="{HEIGHT - 10}" text-anchor="middle">rollout</text>',
             f'<text x="{PAD}" y="20">{metric}</text>']
    for frac in (0.0, 0.5, 1.0):
        y = y_lo + frac * (y_hi - y_lo)
        x0, y0 = at(0, y).split(",")
        parts.append(f'<text x="{float(x0) - 6}" y="{y0}" text-anchor="end">{y:.2f}</text>')
    for i, (name, pts) in enumerate(series.items()):
        color = COLORS[i % len(COLORS)]
        parts.append(f'<polyline points="{" ".join(at(x, y) for x, y in pts)}" fill="none" stroke="{color}" stroke-width="2"/>')
        parts.append(f'<text x="{WIDTH - PAD - 100}" y="{40 + 16 * i}" fill="{color}">{name}</text>')
    parts.append("</svg>")
    return "\n".join(parts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--metric", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("runs", nargs="+", help="name=path/to/metrics.jsonl")
    args = parser.parse_args()
    series = {}
    for run in args.runs:
        name, sep, path = run.partition("=")
        if not sep:
            raise SystemExit(f"error: {run!r} should be name=path/to/metrics.jsonl")
        series[name] = read_series(path, args.metric)
    with open(args.out, "w") as f:
        f.write(svg(series, args.metric))


if __name__ == "__main__":
    main()
