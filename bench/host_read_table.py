"""Host reads per step and tokens/s of plain decoding, fixed and adaptive EAGLE-3 with a tiny
model (one layer, hidden 64) on CPU, where the host dominates a step as on a GPU (issue #44):

    python -m scripts.bench_host_reads --label after \
        --out docs/benchmarks/data/host_reads_after.json

Each configuration runs in one engine: a warm-up generation per batch size, then --repeats timed
greedy generations (EOS ignored) of --output-len tokens from fresh random prompts; tokens/s is
the best run's output tokens over its wall time (prefill included), and per CPU-second of the
process (`tok_cpu_s`: steadier than wall time on a shared machine, where other processes take
the cores for seconds at a time). Host reads are counted on
the scheduler's thread (bench/host_reads.py) over the timed runs' decode steps: mean and most
per plain step and per speculative step. The draft is a random EAGLE-3 draft (it drafts badly:
the adaptive engine mostly decodes plainly), so the table compares host work, not acceptance.

With --host-time it measures instead the scheduler thread's own CPU time per full-batch decode
step (`time.thread_time`, which another process taking the other core moves far less than wall
time), and with --profile N a cProfile of those steps on the same clock (calls per step, top N
entries by cumulative and own time):

    python -m scripts.bench_host_reads --host-time --modes plain eagle3 --batch-sizes 32 128 \
        --repeats 5 --profile 40 --out docs/benchmarks/data/host_time_after.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import pstats
import random
import tempfile
import time
from typing import Any, Optional

import torch

from bench.host_reads import HostCopies, HostReads, StepReads, StepTimes

MODES = ("plain", "eagle3", "eagle3-adaptive")


def build_models(root: str) -> dict[str, str]:
    from tiny.checkpoints import build_eagle_draft, build_tiny_model

    target = os.path.join(root, "target")
    if not os.path.exists(os.path.join(target, "config.json")):
        build_tiny_model(target, num_layers=1)
    draft = os.path.join(root, "eagle3")
    if not os.path.exists(os.path.join(draft, "config.json")):
        build_eagle_draft(draft, target, version=3)
    return {"target": target, "eagle3": draft}


def engine_kwargs(mode: str, models: dict[str, str], max_batch: int) -> dict[str, Any]:
    kwargs: dict[str, Any] = dict(
        model_path=models["target"],
        random_seed=0,
        max_running_requests=max_batch,
        context_length=512,
    )
    if mode != "plain":
        kwargs.update(
            speculative_algorithm="EAGLE3",
            speculative_draft_model_path=models["eagle3"],
            speculative_num_steps=3,
            speculative_eagle_topk=1,
            speculative_num_draft_tokens=4,
            speculative_adaptive=mode == "eagle3-adaptive",
        )
    return kwargs


def measure(engine: Any, batch: int, args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(batch)
    params = {"temperature": 0.0, "max_new_tokens": args.output_len, "ignore_eos": True}

    def prompts() -> list[list[int]]:
        return [[rng.randrange(5, 500) for _ in range(args.input_len)] for _ in range(batch)]

    engine.generate(input_ids=prompts(), sampling_params=params)  # warm-up
    best = best_cpu = float("inf")
    with StepReads(engine, HostCopies if args.copies else HostReads) as counted:
        for _ in range(args.repeats):
            start, cpu = time.perf_counter(), time.process_time()
            engine.generate(input_ids=prompts(), sampling_params=params)
            best = min(best, time.perf_counter() - start)
            best_cpu = min(best_cpu, time.process_time() - cpu)
    tokens = batch * args.output_len
    row: dict[str, Any] = {"batch": batch, "tok_s": tokens / best, "tok_cpu_s": tokens / best_cpu}
    for kind in ("plain", "spec"):
        reads = [s.reads for s in counted.decode_steps(kind)]
        row[f"{kind}_steps"] = len(reads)
        row[f"{kind}_reads_mean"] = sum(reads) / len(reads) if reads else None
        row[f"{kind}_reads_max"] = max(reads) if reads else None
    return row


def host_time(engine: Any, mode: str, batch: int, args: argparse.Namespace) -> dict[str, Any]:
    """Host CPU time per full-batch decode step on the scheduler's thread (`--host-time`): the
    median and mean over the timed runs' steps, then, with --profile N, a cProfile of the same
    runs again (its top N entries by cumulative and by own time)."""
    rng = random.Random(batch)
    params = {"temperature": 0.0, "max_new_tokens": args.output_len, "ignore_eos": True}

    def run() -> None:
        prompts = [[rng.randrange(5, 500) for _ in range(args.input_len)] for _ in range(batch)]
        engine.generate(input_ids=prompts, sampling_params=params)

    run()  # warm-up
    kind = "plain" if mode == "plain" else "spec"
    with StepTimes(engine) as timed:
        for _ in range(args.repeats):
            run()
    ms = sorted(1e3 * s for s in timed.per_step(kind, batch))
    row: dict[str, Any] = {
        "mode": mode,
        "batch": batch,
        "steps": len(ms),
        "host_ms_median": ms[len(ms) // 2],
        "host_ms_mean": sum(ms) / len(ms),
        "host_ms_p10": ms[len(ms) // 10],
    }
    if args.profile:
        with StepTimes(engine, profile=True) as profiled:
            for _ in range(args.repeats):
                run()
        stats = pstats.Stats(profiled.profile)
        # Python and C calls per profiled step (prefills included): load cannot move this.
        row["profile_calls_per_step"] = stats.total_calls / len(profiled.steps)
        row["profile_cumulative"] = profiled.top("cumulative", args.profile)
        row["profile_tottime"] = profiled.top("tottime", args.profile)
        if args.profile_dir:
            os.makedirs(args.profile_dir, exist_ok=True)
            profiled.profile.dump_stats(os.path.join(args.profile_dir, f"{mode}_{batch}.prof"))
    print(
        f"{mode} batch {batch}: {row['host_ms_median']:.3f} ms median, "
        f"{row['host_ms_mean']:.3f} ms mean host CPU per step over {len(ms)} steps",
        flush=True,
    )
    return row


def table(rows: list[dict[str, Any]], what: str = "reads") -> str:
    """`what`: what the counts are (reads, or host-to-device copies with --copies)."""

    def reads(r: dict, kind: str) -> str:
        if not r[f"{kind}_steps"]:
            return "-"
        return f"{r[f'{kind}_reads_mean']:.1f} (max {r[f'{kind}_reads_max']})"

    lines = [
        f"| mode | batch | tokens/s | tokens per CPU-s | {what} per plain step | {what} per spec "
        "step |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['mode']} | {r['batch']} | {r['tok_s']:.0f} | {r['tok_cpu_s']:.0f} | "
            f"{reads(r, 'plain')} | "
            f"{reads(r, 'spec')} |"
        )
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    from spec_engine import Engine

    models = build_models(args.work_dir or tempfile.mkdtemp(prefix="host-reads-"))
    rows = []
    for mode in args.modes:
        with Engine(**engine_kwargs(mode, models, max(args.batch_sizes))) as engine:
            for batch in args.batch_sizes:
                if args.host_time:
                    rows.append(host_time(engine, mode, batch, args))
                    continue
                rows.append({"mode": mode, **measure(engine, batch, args)})
                print(table(rows[-1:]).splitlines()[-1], flush=True)
    if not args.host_time:
        print(table(rows, "copies" if args.copies else "reads"))
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(
                {
                    "label": args.label,
                    "args": vars(args),
                    "torch": torch.__version__,
                    "machine": platform.processor() or platform.machine(),
                    "rows": rows,
                },
                f,
                indent=1,
            )


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 32, 128])
    parser.add_argument("--input-len", type=int, default=16)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--host-time",
        action="store_true",
        help="measure the scheduler thread's CPU time per decode step instead (thread_time)",
    )
    parser.add_argument(
        "--copies",
        action="store_true",
        help="count tensors made from host data per step (host-to-device copies) instead of reads",
    )
    parser.add_argument(
        "--profile", type=int, default=0, help="with --host-time: cProfile, top N entries"
    )
    parser.add_argument("--profile-dir", default=None, help="with --profile: dump .prof files here")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--work-dir", default=None, help="where the tiny models are built")
    parser.add_argument("--label", default="", help="recorded in the JSON (before / after)")
    parser.add_argument("--out", default=None, help="write the rows as JSON here")
    return parser.parse_args(argv)
