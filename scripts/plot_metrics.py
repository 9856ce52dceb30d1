"""Plot one metric of several runs' metrics.jsonl as an SVG line chart (specrl.plots).

    python -m scripts.plot_metrics --metric rollout/spec_accept_length --out plot.svg \\
        online=runs/a/metrics.jsonl frozen=runs/b/metrics.jsonl
"""

from __future__ import annotations

import argparse

from specrl.plots import read_series, svg


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
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
