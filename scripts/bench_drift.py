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


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--root", default="runs/drift-bench")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--num-rollout", type=int, default=60)
    parser.add_argument("--drift-rollout", type=int, default=30, help="rollouts before the shift")
    parser.add_argument("--out", default="docs/benchmarks", help="where the JSON and SVGs go")
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
    args = parser.parse_args()
    modes = {mode: (training, ()) for mode, training in MODES.items()}
    if args.draft_lr is not None:
        modes["online-fast"] = ("1", ("--draft-lr", str(args.draft_lr)))
    if args.arms is not None:
        missing = [arm for arm in args.arms if arm not in modes]
        if missing:
            parser.error(f"--arms {' '.join(missing)} needs --draft-lr")
        modes = {arm: modes[arm] for arm in args.arms}
    name = args.name or f"drift_{args.spec}_cpu"
    d, n = args.drift_rollout, args.num_rollout
    if not 0 < d < n:
        parser.error(f"--drift-rollout {d} must be in [1, --num-rollout {n})")
    drift_at = d * PROMPTS_PER_ROLLOUT
    base_env = {"DRIFT_AT": str(drift_at), "SPEC": args.spec}
    assets = os.path.join(args.root, "assets-run")
    if not (args.reuse and finished(assets, 1)):
        tiny_run(assets, base_env, "--num-rollout", "1")
    added = extend_task(
        os.path.join(assets, "assets", "task.jsonl"), n * PROMPTS_PER_ROLLOUT, drift_at
    )
    if added:
        print(f"task.jsonl: {added} post-shift prompts repeated, for {n} rollouts")
    rows: dict[str, list[list[dict]]] = {mode: [] for mode in modes}
    for seed in args.seeds:
        seeded = ("--rollout-seed", str(seed))
        shared = None
        if args.spec == "eagle3":  # the draft learns until the shift, once for both arms
            shared = os.path.join(args.root, f"before-shift-{seed}")
            if not (args.reuse and finished(shared, d)):
                shared = fresh_run(args.root, f"before-shift-{seed}", assets)
                ckpt = ("--save", os.path.join(shared, "ckpt"))
                fast = () if args.draft_lr is None else ("--draft-lr", str(args.draft_lr))
                tiny_run(shared, base_env, "--num-rollout", str(d), *seeded, *ckpt, *fast)
        for mode, (training, extra) in modes.items():
            run_name = f"{mode}-{seed}"
            out = os.path.join(args.root, run_name)
            if args.reuse and finished(out, n):
                rows[mode].append(read_metrics(os.path.join(out, "metrics.jsonl"))[:n])
                continue
            if shared is None:
                out = fresh_run(args.root, run_name, assets)
                env = {**base_env, "MTP_TRAINING": training}
            else:
                resume = os.path.join(out, "ckpt")
                if not (args.reuse and goes_on_from(out, shared, d)):
                    shutil.rmtree(out, ignore_errors=True)
                    shutil.copytree(shared, out)
                # A longer run than the one kept goes on from its last checkpoint; the copies of
                # the task file that runs read are extended like the prepared one.
                extend_task(
                    os.path.join(out, "assets", "task.jsonl"), n * PROMPTS_PER_ROLLOUT, drift_at
                )
                extra = ("--load", resume, "--save", resume, *extra)
                extra += ("--draft-lr", "0") if training == "0" else ()
                env = base_env
            tiny_run(out, env, "--num-rollout", str(n), *seeded, *extra)
            rows[mode].append(read_metrics(os.path.join(out, "metrics.jsonl")))

    last = n - n // 3  # the last third: rollouts last+1..n (41-60 of 60, 61-90 of 90)
    windows = {
        f"1-{d} (before)": (0, d),
        f"{d + 1}-{min(d + 10, n)} (just after)": (d, min(d + 10, n)),
        f"{last + 1}-{n} (last third)": (last, n),
    }
    head = [f"{m} {w}" for m in METRICS for w in windows]
    table = ["| draft | seed | " + " | ".join(head) + " |", "|---|---:|" + "---:|" * len(head)]
    summary = {}
    for mode, runs in rows.items():
        cells = {(m, w): [] for m in METRICS for w in windows}
        for seed, run in zip(args.seeds, runs):
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
    print("\n".join(table))
    late = f"accept {list(windows)[-1]}"
    ratios = {}
    for mode in rows:
        if mode != "frozen" and "frozen" in rows:
            per_seed = [
                statistics.mean(r[METRICS["accept"]] for r in on[last:n])
                / statistics.mean(r[METRICS["accept"]] for r in off[last:n])
                for on, off in zip(rows[mode], rows["frozen"])
            ]
            ratios[mode] = {
                "mean": summary[mode][late] / summary["frozen"][late],
                "per_seed": dict(zip(args.seeds, per_seed)),
            }
            print(
                f"{mode} / frozen, {late}: {ratios[mode]['mean']:.3f}x (per seed "
                + ", ".join(f"{v:.3f}x" for v in per_seed)
                + ")"
            )

    os.makedirs(args.out, exist_ok=True)
    per_rollout = {
        f"{mode}-{seed}": [
            {k: r.get(k) for k in ("rollout_id", *PER_ROLLOUT) if k in r} for r in run
        ]
        for mode, runs in rows.items()
        for seed, run in zip(args.seeds, runs)
    }
    config = {
        "spec": args.spec,
        "seeds": args.seeds,
        "num_rollout": n,
        "drift_rollout": d,
        "draft_lr": args.draft_lr,
        "arms": list(modes),
        "windows": {w: [a + 1, b] for w, (a, b) in windows.items()},
    }
    with open(os.path.join(args.out, f"{name}.json"), "w") as f:
        result = {"config": config, "summary": summary, "last_third_ratio": ratios}
        json.dump({**result, "per_rollout": per_rollout}, f, indent=1)
    for m, metric in METRICS.items():
        series = {
            mode: [(i + 1, statistics.mean(run[i][metric] for run in runs)) for i in range(n)]
            for mode, runs in rows.items()
        }
        with open(os.path.join(args.out, f"{name}_{m}.svg"), "w") as f:
            f.write(svg(series, f"{metric} (mean of {len(args.seeds)} seeds)"))


if __name__ == "__main__":
    main()
