"""Frozen vs online-trained draft on the tiny drift task (docs/benchmarks/drift_mtp_cpu.md,
docs/benchmarks/drift_eagle3_cpu.md).

    python -m scripts.bench_drift --root runs/drift-bench --seeds 1 2 3             # MTP
    python -m scripts.bench_drift --spec eagle3 --root runs/drift-e3 --seeds 1 2 3  # EAGLE-3

Prepares the drift task's assets once (scripts/run-tiny-cpu.sh TASK=drift: from rollout
--drift-rollout on, responses must stop repeating their first token), then per seed runs the
same command twice, with the draft trained online and frozen, and writes the accept length and
reward per window (before the shift, just after, late) as a Markdown table, the per-rollout
values as JSON, and the seed-mean curves as SVG charts (specrl.plots). MTP: the MTP layer the
warm-up trained, frozen (MTP_TRAINING=0) or trained on. EAGLE-3 (SPEC=eagle3): a random draft
trained online until the shift (one run per seed, saved), then resumed twice from that
checkpoint, trained on or frozen (--draft-lr 0); with --draft-lr X it learns at X before the shift
and a third arm, online-fast, goes on at X.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess

from specrl.plots import read_metrics, svg

MODES = {"online": "1", "frozen": "0"}  # MTP_TRAINING; "online-fast" (--draft-lr) is optional
PROMPTS_PER_ROLLOUT = 4  # run-tiny-cpu.sh's --rollout-batch-size
METRICS = {"accept": "rollout/spec_accept_length", "reward": "rollout/raw_reward"}


def tiny_run(out: str, env: dict[str, str], *flags: str) -> None:
    log = out + ".log"
    os.makedirs(os.path.dirname(os.path.abspath(log)), exist_ok=True)
    with open(log, "w") as f:
        done = subprocess.run(
            ["bash", "scripts/run-tiny-cpu.sh", *flags],
            env={**os.environ, "OUT": out, "TASK": "drift", **env},
            stdout=f,
            stderr=subprocess.STDOUT,
        )
    if done.returncode:
        raise SystemExit(f"{out}: run-tiny-cpu.sh failed (rc {done.returncode}), see {log}")


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
    args = parser.parse_args()
    modes = {mode: (training, ()) for mode, training in MODES.items()}
    if args.draft_lr is not None:
        modes["online-fast"] = ("1", ("--draft-lr", str(args.draft_lr)))
    drift_at = str(args.drift_rollout * PROMPTS_PER_ROLLOUT)
    base_env = {"DRIFT_AT": drift_at, "SPEC": args.spec}
    assets = os.path.join(args.root, "assets-run")
    tiny_run(assets, base_env, "--num-rollout", "1")
    rows: dict[str, list[list[dict]]] = {mode: [] for mode in modes}
    for seed in args.seeds:
        seeded = ("--rollout-seed", str(seed))
        shared = None
        if args.spec == "eagle3":  # the draft learns until the shift, once for both arms
            shared = fresh_run(args.root, f"before-shift-{seed}", assets)
            ckpt = ("--save", os.path.join(shared, "ckpt"))
            fast = () if args.draft_lr is None else ("--draft-lr", str(args.draft_lr))
            tiny_run(
                shared, base_env, "--num-rollout", str(args.drift_rollout), *seeded, *ckpt, *fast
            )
        for mode, (training, extra) in modes.items():
            name = f"{mode}-{seed}"
            if shared is None:
                out = fresh_run(args.root, name, assets)
                env = {**base_env, "MTP_TRAINING": training}
            else:
                out = os.path.join(args.root, name)
                shutil.rmtree(out, ignore_errors=True)
                shutil.copytree(shared, out)
                resume = os.path.join(out, "ckpt")
                extra = ("--load", resume, "--save", resume, *extra)
                extra += ("--draft-lr", "0") if training == "0" else ()
                env = base_env
            tiny_run(out, env, "--num-rollout", str(args.num_rollout), *seeded, *extra)
            rows[mode].append(read_metrics(os.path.join(out, "metrics.jsonl")))

    d, n = args.drift_rollout, args.num_rollout
    windows = {
        f"1-{d} (before)": (0, d),
        f"{d + 1}-{d + 10} (just after)": (d, d + 10),
        f"{d + 11}-{n} (late)": (d + 10, n),
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

    os.makedirs(args.out, exist_ok=True)
    per_rollout = {
        f"{mode}-{seed}": [{k: r.get(k) for k in ("rollout_id", *METRICS.values())} for r in run]
        for mode, runs in rows.items()
        for seed, run in zip(args.seeds, runs)
    }
    with open(os.path.join(args.out, f"drift_{args.spec}_cpu.json"), "w") as f:
        json.dump({"summary": summary, "per_rollout": per_rollout}, f, indent=1)
    for m, metric in METRICS.items():
        series = {
            mode: [(i + 1, statistics.mean(run[i][metric] for run in runs)) for i in range(n)]
            for mode, runs in rows.items()
        }
        with open(os.path.join(args.out, f"drift_{args.spec}_cpu_{m}.svg"), "w") as f:
            f.write(svg(series, f"{metric} (mean of {len(args.seeds)} seeds)"))


if __name__ == "__main__":
    main()
