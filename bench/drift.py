"""Frozen vs online-trained draft on the tiny drift task (docs/benchmarks/drift_mtp_cpu.md,
docs/benchmarks/drift_eagle3_cpu.md).

    python -m scripts.bench_drift --root runs/drift-bench --seeds 1 2 3             # MTP
    python -m scripts.bench_drift --spec eagle3 --root runs/drift-e3 --seeds 1 2 3  # EAGLE-3

Prepares the drift task's assets once (scripts/run-tiny-cpu.sh TASK=drift: from rollout
--drift-rollout on, responses must stop repeating their first token), then per seed runs the
same command twice, with the draft trained online and frozen, and writes the accept length and
reward per window (before the shift, the 10 rollouts just after it, and the last third of the
run) as a Markdown table, the per-rollout values as JSON, and the seed-mean curves as SVG charts
(specrl.plots), named --name (default drift_<spec>_cpu). MTP: the MTP layer the
warm-up trained, frozen (MTP_TRAINING=0) or trained on. EAGLE-3 (SPEC=eagle3): a random draft
trained online until the shift (one run per seed, saved), then resumed twice from that
checkpoint, trained on or frozen (--draft-lr 0); with --draft-lr X it learns at X before the shift
and a third arm, online-fast, goes on at X. --arms runs only the named arms,
e.g. (docs/benchmarks/drift_eagle3_cpu.md)

    python -m scripts.bench_drift --spec eagle3 --num-rollout 90 --draft-lr 1e-2 \\
        --arms online-fast frozen --name drift_eagle3_long_cpu

The task file holds 256 prompts (tiny.run_assets), 64 rollouts' worth; a longer run would wrap
around to the prompts before the shift, so the file is extended by repeating its post-shift
prompts in order, and every rollout after the shift is scored by the shifted reward. --reuse
keeps runs that already finished (their metrics.jsonl has every rollout), so more seeds can be
added to a finished measurement, and (EAGLE-3) a kept run shorter than --num-rollout goes on
from its last checkpoint, so a run can be made longer without running its start again. A run
that fails to start (Ray's start-up wait, a taken port on a busy machine) is started again.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
from dataclasses import dataclass
from typing import Optional

from specrl.plots import read_metrics, svg
from tiny.run_assets import TASK_PROMPTS

MODES = {"online": "1", "frozen": "0"}  # MTP_TRAINING; "online-fast" (--draft-lr) is optional
ARMS = ("online", "frozen", "online-fast")
PROMPTS_PER_ROLLOUT = 4  # run-tiny-cpu.sh's --rollout-batch-size
METRICS = {"accept": "rollout/spec_accept_length", "reward": "rollout/raw_reward"}
# Also kept per rollout in the JSON: the policy's entropy (how predictable its tokens are) and
# the draft's first-step loss (EAGLE-3: computed with --draft-lr 0 too; MTP: train/mtp_loss).
PER_ROLLOUT = (*METRICS.values(), "train/entropy", "train/draft_loss/step_0", "train/mtp_loss")


# Failures of a run's start on a busy machine: Ray's head node missing its fixed 30 s start-up
# wait, or the trainer's rendezvous port taken by another process meanwhile.
START_ERRORS = ("The current node timed out during startup", "EADDRINUSE")
START_TRIES = 3
ROLLOUT_LINE = re.compile(r"rollout \d+/\d+:")
LATEST = "latest_checkpointed_iteration.txt"  # a checkpoint directory holding one


def tiny_run(out: str, env: dict[str, str], *flags: str) -> None:
    """One run of scripts/run-tiny-cpu.sh into `out`, its output in `out`.log. A run that failed
    to start (START_ERRORS, before its first rollout, so nothing in `out` moved on) is started
    again, up to START_TRIES times."""
    log = out + ".log"
    os.makedirs(os.path.dirname(os.path.abspath(log)), exist_ok=True)
    for attempt in range(1, START_TRIES + 1):
        with open(log, "w") as f:
            done = subprocess.run(
                ["bash", "scripts/run-tiny-cpu.sh", *flags],
                env={**os.environ, "OUT": out, "TASK": "drift", **env},
                stdout=f,
                stderr=subprocess.STDOUT,
            )
        if not done.returncode:
            return
        with open(log) as f:
            text = f.read()
        start = any(e in text for e in START_ERRORS) and not ROLLOUT_LINE.search(text)
        if not start or attempt == START_TRIES:
            break
        shutil.copy(log, f"{log}.failed-start-{attempt}")
        print(f"{out}: the run failed to start (try {attempt}, see {log}.failed-start-{attempt})")
    raise SystemExit(f"{out}: run-tiny-cpu.sh failed (rc {done.returncode}), see {log}")


def finished(out: str, num_rollout: int) -> bool:
    """Whether the run in `out` logged all `num_rollout` rollouts."""
    path = os.path.join(out, "metrics.jsonl")
    return os.path.exists(path) and len(read_metrics(path)) >= num_rollout


def extend_task(path: str, num_prompts: int, drift_at: int) -> int:
    """Make the task file at `path` hold at least `num_prompts` prompts, so that the data source
    does not wrap around to the prompts before the shift: the written task's prompts from
    `drift_at` on repeat in order, line j being the same whether the file was extended once or
    several times. The first lines stay as they were. Returns the number of lines added."""
    with open(path) as f:
        lines = [line for line in f if line.strip()]
    after = lines[drift_at:TASK_PROMPTS]
    if len(lines) >= num_prompts:
        return 0
    if not after:
        raise SystemExit(f"{path}: no prompts after the shift ({drift_at}) to repeat")
    added = [after[(j - drift_at) % len(after)] for j in range(len(lines), num_prompts)]
    with open(path, "a") as f:
        f.writelines(added)
    return len(added)


def goes_on_from(out: str, shared: str, drift_rollout: int) -> bool:
    """Whether the kept run in `out` has a checkpoint and started from the run in `shared`
    as it is now (the same first `drift_rollout` rollouts): else it is started again."""
    paths = [os.path.join(run, "metrics.jsonl") for run in (out, shared)]
    if not (os.path.exists(os.path.join(out, "ckpt", LATEST)) and all(map(os.path.exists, paths))):
        return False
    mine, theirs = (read_metrics(p)[:drift_rollout] for p in paths)
    return len(mine) == drift_rollout and mine == theirs


def fresh_run(root: str, name: str, assets: str) -> str:
    """An empty run directory holding a copy of the prepared assets."""
    out = os.path.join(root, name)
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(os.path.join(assets, "assets"), os.path.join(out, "assets"))
    return out


@dataclass(frozen=True)
class Plan:
    """One measurement: the arms (mode -> (MTP_TRAINING, extra flags)), the seeds, the runs'
    length and shift, and where the runs go."""

    root: str
    seeds: list[int]
    num_rollout: int
    drift_rollout: int
    spec: str
    draft_lr: Optional[float]
    reuse: bool
    modes: dict[str, tuple[str, tuple[str, ...]]]

    @property
    def drift_at(self) -> int:
        """The first prompt after the shift."""
        return self.drift_rollout * PROMPTS_PER_ROLLOUT

    @property
    def env(self) -> dict[str, str]:
        """run-tiny-cpu.sh's environment for every run."""
        return {"DRIFT_AT": str(self.drift_at), "SPEC": self.spec}

    @property
    def assets(self) -> str:
        """The run that prepared the task's assets, which every run copies."""
        return os.path.join(self.root, "assets-run")

    def extend(self, run: str) -> int:
        """extend_task on `run`'s task file, for num_rollout rollouts."""
        path = os.path.join(run, "assets", "task.jsonl")
        return extend_task(path, self.num_rollout * PROMPTS_PER_ROLLOUT, self.drift_at)


def main(argv: Optional[list[str]] = None) -> None:
    plan, out, name = parse_args(argv)
    if not (plan.reuse and finished(plan.assets, 1)):
        tiny_run(plan.assets, plan.env, "--num-rollout", "1")
    added = plan.extend(plan.assets)
    if added:
        print(f"task.jsonl: {added} post-shift prompts repeated, for {plan.num_rollout} rollouts")
    rows: dict[str, list[list[dict]]] = {mode: [] for mode in plan.modes}
    for seed in plan.seeds:
        shared = before_shift(plan, seed) if plan.spec == "eagle3" else None
        for mode in plan.modes:
            rows[mode].append(run_arm(plan, mode, seed, shared))
    windows = plan_windows(plan)
    table, summary = summary_table(rows, plan.seeds, windows)
    print("\n".join(table))
    ratios = last_third_ratios(rows, plan, summary, windows)
    write(out, name, plan, rows, {"summary": summary, "last_third_ratio": ratios}, windows)


def parse_args(argv: Optional[list[str]] = None) -> tuple[Plan, str, str]:
    """The plan, the output directory and the file name stem."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--root", default="runs/drift-bench")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--num-rollout", type=int, default=60)
    parser.add_argument("--drift-rollout", type=int, default=30, help="rollouts before the shift")
    parser.add_argument(
        "--out", default="docs/benchmarks", help="where data/NAME.json and plots/NAME_*.svg go"
    )
    parser.add_argument(
        "--draft-lr",
        type=float,
        default=None,
        help="also run the online draft with this --draft-lr (mode online-fast); EAGLE-3: the "
        "draft also learns at this rate before the shift, for every arm",
    )
    parser.add_argument("--spec", choices=["mtp", "eagle3"], default="mtp")
    parser.add_argument(
        "--arms",
        nargs="+",
        choices=ARMS,
        default=None,
        help="the arms to run (default: online and frozen, and online-fast with --draft-lr)",
    )
    parser.add_argument(
        "--name", default=None, help="file name stem of the JSON and SVGs (drift_<spec>_cpu)"
    )
    parser.add_argument(
        "--reuse", action="store_true", help="keep runs under --root that already finished"
    )
    args = parser.parse_args(argv)
    modes = {mode: (training, ()) for mode, training in MODES.items()}
    if args.draft_lr is not None:
        modes["online-fast"] = ("1", ("--draft-lr", str(args.draft_lr)))
    if args.arms is not None:
        missing = [arm for arm in args.arms if arm not in modes]
        if missing:
            parser.error(f"--arms {' '.join(missing)} needs --draft-lr")
        modes = {arm: modes[arm] for arm in args.arms}
    d, n = args.drift_rollout, args.num_rollout
    if not 0 < d < n:
        parser.error(f"--drift-rollout {d} must be in [1, --num-rollout {n})")
    plan = Plan(args.root, args.seeds, n, d, args.spec, args.draft_lr, args.reuse, modes)
    return plan, args.out, args.name or f"drift_{args.spec}_cpu"


def before_shift(plan: Plan, seed: int) -> str:
    """EAGLE-3: the run in which the draft learns until the shift, once for every arm (kept
    with --reuse when it finished)."""
    shared = os.path.join(plan.root, f"before-shift-{seed}")
    if not (plan.reuse and finished(shared, plan.drift_rollout)):
        shared = fresh_run(plan.root, f"before-shift-{seed}", plan.assets)
        ckpt = ("--save", os.path.join(shared, "ckpt"))
        fast = () if plan.draft_lr is None else ("--draft-lr", str(plan.draft_lr))
        seeded = ("--rollout-seed", str(seed))
        tiny_run(shared, plan.env, "--num-rollout", str(plan.drift_rollout), *seeded, *ckpt, *fast)
    return shared


def run_arm(plan: Plan, mode: str, seed: int, shared: Optional[str]) -> list[dict]:
    """The per-rollout metrics of arm `mode` at `seed`: a whole run (MTP), or one that goes on
    from `shared`'s checkpoint at the shift (EAGLE-3); a finished one kept with --reuse."""
    training, extra = plan.modes[mode]
    n = plan.num_rollout
    run_name = f"{mode}-{seed}"
    out = os.path.join(plan.root, run_name)
    if plan.reuse and finished(out, n):
        return read_metrics(os.path.join(out, "metrics.jsonl"))[:n]
    if shared is None:
        out = fresh_run(plan.root, run_name, plan.assets)
        env = {**plan.env, "MTP_TRAINING": training}
    else:
        resume = os.path.join(out, "ckpt")
        if not (plan.reuse and goes_on_from(out, shared, plan.drift_rollout)):
            shutil.rmtree(out, ignore_errors=True)
            shutil.copytree(shared, out)
        # A longer run than the one kept goes on from its last checkpoint; the copies of the task
        # file that runs read are extended like the prepared one.
        plan.extend(out)
        extra = ("--load", resume, "--save", resume, *extra)
        extra += ("--draft-lr", "0") if training == "0" else ()
        env = plan.env
    tiny_run(out, env, "--num-rollout", str(n), "--rollout-seed", str(seed), *extra)
    return read_metrics(os.path.join(out, "metrics.jsonl"))


def plan_windows(plan: Plan) -> dict[str, tuple[int, int]]:
    """The reported windows of rollouts, as slices: before the shift, the ten just after it, the
    last third."""
    d, n = plan.drift_rollout, plan.num_rollout
    last = n - n // 3  # the last third: rollouts last+1..n (41-60 of 60, 61-90 of 90)
    return {
        f"1-{d} (before)": (0, d),
        f"{d + 1}-{min(d + 10, n)} (just after)": (d, min(d + 10, n)),
        f"{last + 1}-{n} (last third)": (last, n),
    }


def summary_table(
    rows: dict[str, list[list[dict]]], seeds: list[int], windows: dict[str, tuple[int, int]]
) -> tuple[list[str], dict[str, dict[str, float]]]:
    """The Markdown table (each metric's mean per window, per arm and seed, and the arm's mean
    over seeds) and the means by arm."""
    head = [f"{m} {w}" for m in METRICS for w in windows]
    table = ["| draft | seed | " + " | ".join(head) + " |", "|---|---:|" + "---:|" * len(head)]
    summary = {}
    for mode, runs in rows.items():
        cells: dict[tuple[str, str], list[float]] = {(m, w): [] for m in METRICS for w in windows}
        for seed, run in zip(seeds, runs):
            for (m, w), values in cells.items():
                a, b = windows[w]
                values.append(statistics.mean(r[METRICS[m]] for r in run[a:b]))
            table.append(
                f"| {mode} | {seed} | " + " | ".join(f"{v[-1]:.2f}" for v in cells.values()) + " |"
            )
        means = {k: statistics.mean(v) for k, v in cells.items()}
        table.append(
            f"| **{mode}** | mean | " + " | ".join(f"**{v:.2f}**" for v in means.values()) + " |"
        )
        summary[mode] = {f"{m} {w}": v for (m, w), v in means.items()}
    return table, summary


def last_third_ratios(
    rows: dict[str, list[list[dict]]],
    plan: Plan,
    summary: dict[str, dict[str, float]],
    windows: dict[str, tuple[int, int]],
) -> dict[str, dict]:
    """Each trained arm's accept length in the last third over the frozen arm's (the mean of
    the seeds' means, and per seed), printed."""
    late = f"accept {list(windows)[-1]}"
    first, end = windows[list(windows)[-1]]
    ratios = {}
    for mode in rows:
        if mode != "frozen" and "frozen" in rows:
            per_seed = [
                statistics.mean(r[METRICS["accept"]] for r in on[first:end])
                / statistics.mean(r[METRICS["accept"]] for r in off[first:end])
                for on, off in zip(rows[mode], rows["frozen"])
            ]
            ratios[mode] = {
                "mean": summary[mode][late] / summary["frozen"][late],
                "per_seed": dict(zip(plan.seeds, per_seed)),
            }
            print(
                f"{mode} / frozen, {late}: {ratios[mode]['mean']:.3f}x (per seed "
                + ", ".join(f"{v:.3f}x" for v in per_seed)
                + ")"
            )
    return ratios


def write(
    out: str,
    name: str,
    plan: Plan,
    rows: dict[str, list[list[dict]]],
    result: dict,
    windows: dict[str, tuple[int, int]],
) -> None:
    """`name`.json (the configuration, `result`, the per-rollout values) in `out`/data and one SVG
    per metric of the seed-mean curves in `out`/plots: docs/benchmarks' layout."""
    data, plots = os.path.join(out, "data"), os.path.join(out, "plots")
    os.makedirs(data, exist_ok=True)
    os.makedirs(plots, exist_ok=True)
    per_rollout = {
        f"{mode}-{seed}": [
            {k: r.get(k) for k in ("rollout_id", *PER_ROLLOUT) if k in r} for r in run
        ]
        for mode, runs in rows.items()
        for seed, run in zip(plan.seeds, runs)
    }
    config = {
        "spec": plan.spec,
        "seeds": plan.seeds,
        "num_rollout": plan.num_rollout,
        "drift_rollout": plan.drift_rollout,
        "draft_lr": plan.draft_lr,
        "arms": list(plan.modes),
        "windows": {w: [a + 1, b] for w, (a, b) in windows.items()},
    }
    with open(os.path.join(data, f"{name}.json"), "w") as f:
        json.dump({"config": config, **result, "per_rollout": per_rollout}, f, indent=1)
    for m, metric in METRICS.items():
        series = {
            mode: [
                (i + 1, statistics.mean(run[i][metric] for run in runs))
                for i in range(plan.num_rollout)
            ]
            for mode, runs in rows.items()
        }
        with open(os.path.join(plots, f"{name}_{m}.svg"), "w") as f:
            f.write(svg(series, f"{metric} (mean of {len(plan.seeds)} seeds)"))


if __name__ == "__main__":
    main()
