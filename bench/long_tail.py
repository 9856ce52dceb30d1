"""Synchronous vs --partial-rollout vs scripts/train_async.py on the long-tailed tiny task, each
with fixed and with adaptive speculation (docs/benchmarks/long_tail_cpu.md).

    python -m scripts.bench_long_tail --root runs/long-tail --num-rollout 16 \\
        --json docs/benchmarks/data/long_tail_cpu.json

Prepares the long-tailed task's assets once (`TASK=longtail` of scripts/run-tiny-cpu.sh: each
prompt asks for a response length drawn from a Pareto distribution, rollout.tiny_task), then
runs each arm, one after another, as `TASK=longtail bash scripts/run-tiny-cpu.sh` on those
assets (MTP speculation, 2 steps, trained online) with the arm's loop and flags (`ARMS`,
`SPECS`). Per arm: the loop's wall time per rollout (the mean `perf/step_time`: generating,
training, pushing; in the async loop the generation of the next rollout runs inside it), the
rollout's own time and its tail (`perf/rollout_time`, `perf/rollout_tail_time`), the trainer's
wait for a rollout (async), the reward over the first and last thirds, and the staleness of the
trained tokens. Printed as a Markdown table; every arm's per-rollout values go to --json and the
reward curves to --plot. Extra flags after `--` go to every arm (a GPU run: see the page);
--report-only reads the arms' last runs under --root again (after rerunning some with --arms).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from specrl.plots import read_metrics, svg

# arm -> (scripts/<loop>.py, its flags); --partial-rollout over-samples so that a rollout has
# groups left in flight when its batch is full, which the next one continues.
ARMS = {
    "sync": ("train", []),
    "partial": ("train", ["--partial-rollout", "--over-sampling-batch-size", "8"]),
    "async": ("train_async", []),
}
START_TRIES = 3
SPECS = {"fixed": [], "adaptive": ["--sglang-speculative-adaptive"]}
PER_ROLLOUT = (
    "perf/step_time",
    "perf/rollout_time",
    "perf/rollout_tail_time",
    "perf/wait_rollout_time",
    "rollout/raw_reward",
    "rollout/response_len/mean",
    "rollout/spec_accept_length",
    "rollout/weight_version_lag/max",
)


def prepare(root: str) -> str:
    """The long-tailed task's assets (built once under root/assets); their path."""
    assets = os.path.join(root, "assets")
    if not os.path.isdir(os.path.join(assets, "warm")):
        cmd = [sys.executable, "-m", "scripts.prepare_tiny_run", "--out", assets]
        subprocess.run(cmd + ["--steps", "400", "--long-tail"], check=True)
    return os.path.abspath(assets)


def run_arm(root: str, assets: str, name: str, num_rollout: int, extra: list[str]) -> str:
    """One arm's run on the shared assets; its output directory."""
    arm, spec = name.split("/")
    loop, flags = ARMS[arm]
    out = os.path.join(root, name.replace("/", "-"))
    os.makedirs(out, exist_ok=True)
    if not os.path.exists(os.path.join(out, "assets")):
        os.symlink(assets, os.path.join(out, "assets"))
    env = {**os.environ, "OUT": out, "TASK": "longtail", "LOOP": loop}
    cmd = ["bash", "scripts/run-tiny-cpu.sh", "--num-rollout", str(num_rollout)]
    cmd += flags + SPECS[spec] + extra
    for _ in range(START_TRIES):  # a busy machine may miss Ray's start-up wait: again, afresh
        if os.path.exists(os.path.join(out, "metrics.jsonl")):
            os.remove(os.path.join(out, "metrics.jsonl"))
        start = time.perf_counter()
        with open(os.path.join(out, "log.txt"), "w") as log:
            code = subprocess.run(cmd, env=env, stdout=log, stderr=log).returncode
        print(f"{name}: {time.perf_counter() - start:.0f} s, exit {code}", file=sys.stderr)
        if code == 0:
            return out
    raise SystemExit(f"{name} failed {START_TRIES} times; see {out}/log.txt")


def summarize(rows: list[dict]) -> dict[str, float]:
    """An arm's means over its rollouts (rollout 0 left out of the times: the async loop has
    nothing to overlap it with; the median wall time too, robust to a busy machine's spikes),
    and its reward over the first and last thirds."""

    def mean(key: str, rows: list[dict] = rows[1:]) -> float:
        values = [r[key] for r in rows if r.get(key) is not None]
        return statistics.fmean(values) if values else float("nan")

    third = max(1, len(rows) // 3)
    return {
        "wall_per_rollout_s": mean("perf/step_time"),
        "wall_median_s": statistics.median(r["perf/step_time"] for r in rows[1:]),
        "rollout_time_s": mean("perf/rollout_time"),
        "tail_time_s": mean("perf/rollout_tail_time"),
        "wait_rollout_s": mean("perf/wait_rollout_time"),
        "reward_first_third": mean("rollout/raw_reward", rows[:third]),
        "reward_last_third": mean("rollout/raw_reward", rows[-third:]),
        "response_len": mean("rollout/response_len/mean"),
        "accept_length": mean("rollout/spec_accept_length"),
        "lag_max": max((r.get("rollout/weight_version_lag/max") or 0.0) for r in rows),
    }


def table(results: dict[str, dict[str, float]]) -> str:
    columns = list(next(iter(results.values())))
    lines = ["| arm | " + " | ".join(columns) + " |", "|---" * (len(columns) + 1) + "|"]
    for name, values in results.items():
        lines.append(f"| {name} | " + " | ".join(f"{values[c]:.3g}" for c in columns) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--root", default="runs/long-tail", help="Where the runs go.")
    parser.add_argument("--num-rollout", type=int, default=16)
    names = [f"{a}/{s}" for s in SPECS for a in ARMS]
    parser.add_argument("--arms", nargs="+", default=names, choices=names)
    parser.add_argument("--json", help="Write every arm's summary and per-rollout values here.")
    parser.add_argument("--plot", help="Write the reward curves here (SVG).")
    parser.add_argument(
        "--report-only", action="store_true", help="Run nothing: report the arms' last runs."
    )
    parser.add_argument("extra", nargs="*", help="Flags for every arm, after --.")
    args = parser.parse_args(argv)
    if args.report_only:
        outs = {n: os.path.join(args.root, n.replace("/", "-")) for n in args.arms}
    else:
        assets = prepare(args.root)
        outs = {n: run_arm(args.root, assets, n, args.num_rollout, args.extra) for n in args.arms}
    rows = {n: read_metrics(os.path.join(o, "metrics.jsonl")) for n, o in outs.items()}
    results = {n: summarize(r) for n, r in rows.items()}
    print(table(results))
    if args.json:
        per_rollout = {
            n: {k: [r.get(k) for r in rs] for k in PER_ROLLOUT} for n, rs in rows.items()
        }
        data = {"command": sys.argv, "summary": results, "per_rollout": per_rollout}
        with open(args.json, "w") as f:
            json.dump(data, f, indent=1)
    if args.plot:
        reward = "rollout/raw_reward"
        curves = {
            n: [(r["step"], r[reward]) for r in rs if r.get(reward) is not None]
            for n, rs in rows.items()
        }
        with open(args.plot, "w") as f:
            f.write(svg(curves, reward))
