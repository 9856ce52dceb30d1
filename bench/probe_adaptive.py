"""Where a speculative step's time goes on a GPU: per-step times of the same EAGLE-3 round in a
fixed engine, in --speculative-adaptive engines whose mode is forced (always the deepest; plain
and deepest alternating) and in one left to choose, and optionally a profile of ten speculative
steps (--profile torch: kernels and ATen ops; python: cProfile of the scheduler's thread).

    python -m scripts.gpu.probe_adaptive --work-dir /tmp/specrl-bench --batch 32 --json probe.json
    bash scripts/gpu/runbook.sh probe --batch 32 --profile python   # builds the checkpoints first

Runs on the random 8B checkpoints a `scripts.bench_rollout --preset llama-3.1-8b --algorithms
eagle3 --work-dir W` run built in W, with a perfect draft (--forced-acceptance's threshold and
temperature 1); each engine runs one untimed generation first, as bench_rollout does. What it
found on an H200 (docs/benchmarks/gpu_NVIDIA_H200.md, fourth lease): a batch-32 step is
bound by the host, not the GPU, and the host's speed drifts by 40% within a minute.
"""

from __future__ import annotations

import argparse
import cProfile
import glob
import io
import json
import os
import pstats
import statistics
import time
from collections.abc import Callable
from typing import Optional

import torch

from bench.measure import open_engine


class _StepProfiler:
    """`fn` that, once armed, profiles its next `steps` calls in the scheduler's thread (the
    profilers see only the thread they start in): `kind` torch (kernels and ATen ops) or python
    (cProfile: where the host's time goes)."""

    def __init__(self, fn: Callable, steps: int, kind: str) -> None:
        self.fn, self.steps, self.kind, self.left, self.prof = fn, steps, kind, 0, None

    def arm(self) -> None:
        self.left = self.steps

    def __call__(self, *args, **kwargs):
        if self.left == self.steps:
            if self.kind == "python":
                self.prof = cProfile.Profile()
                self.prof.enable()
            else:
                activities = [torch.profiler.ProfilerActivity.CPU]
                if torch.cuda.is_available():
                    activities.append(torch.profiler.ProfilerActivity.CUDA)
                self.prof = torch.profiler.profile(activities=activities)
                self.prof.start()
        out = self.fn(*args, **kwargs)
        if self.left:
            self.left -= 1
            if not self.left:
                _sync()
                self.prof.disable() if self.kind == "python" else self.prof.stop()
        return out

    def table(self) -> Optional[str]:
        if self.prof is None:
            return None
        if self.kind == "torch":
            sort = "cuda_time_total" if torch.cuda.is_available() else "cpu_time_total"
            return self.prof.key_averages().table(sort_by=sort, row_limit=40)
        text = io.StringIO()
        pstats.Stats(self.prof, stream=text).sort_stats("tottime").print_stats(35)
        return text.getvalue()


def _memory() -> dict:
    """The CUDA caching allocator's counters (cudaMalloc/cudaFree calls, retries)."""
    if not torch.cuda.is_available():
        return {}
    stats = torch.cuda.memory_stats()
    keys = ("num_alloc_retries", "num_device_alloc", "num_device_free", "num_sync_all_streams")
    return {k: stats.get(k, 0) for k in keys}


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _timed(records: list, kind: str, fn: Callable, depth_of: Callable) -> Callable:
    """`fn` wrapped to append (kind, depth, batch, ms) after a CUDA synchronize (kind "plain"
    for a call at depth 0: a decode without speculation)."""

    def wrapper(reqs, *args, **kwargs):
        _sync()
        start = time.perf_counter()
        out = fn(reqs, *args, **kwargs)
        _sync()
        depth = depth_of(args, kwargs)
        ms = 1000 * (time.perf_counter() - start)
        records.append(("plain" if depth == 0 else kind, depth, len(reqs), ms))
        return out

    return wrapper


def _run(path: str, kwargs: dict, batch: int, args: argparse.Namespace, force=None) -> dict:
    """One case: bench_rollout's engine for one batch size, every draft token accepted
    (--forced-acceptance), its worker's steps timed (and `force`'s modes taken in turn by an
    adaptive one), over a warm-up generation and a timed one."""
    engine = open_engine(path, {**kwargs, "speculative_accept_threshold_single": 1e-9}, batch, args)
    try:
        records, prof = _instrument(engine.scheduler, args)
        adaptive = getattr(engine.scheduler.policy, "adaptive", None)
        if force is not None and adaptive is not None:
            _force(adaptive, force)
        generation = _generate(engine, batch, args, records, prof)
        table = prof.table()
        report = engine.get_server_info()["internal_states"][0].get("spec_adaptive")
    finally:
        engine.shutdown()
    return {
        "split_ms_total": generation["split_ms_total"],
        "profile": table,
        "allocator": generation["allocator"],
        "tokens_per_s": generation["tokens_per_s"],
        "summary": _summary(records),
        "steps": [(k, d, round(m, 3)) for k, d, _, m in records],
        "cost_model": report
        and {
            "buckets": report["buckets"],
            "latest_steps": report["latest_steps"],
        },
    }


def _instrument(sched, args: argparse.Namespace) -> tuple[list, _StepProfiler]:
    """The worker's speculative, plain and catch-up steps timed into the records returned, its
    speculative steps through the profiler returned."""
    worker = sched.worker
    records: list = []
    prof = _StepProfiler(worker.decode, args.profile_steps, args.profile or "python")
    worker.decode = _timed(records, "spec", prof, lambda a, k: a[0] if a else None)
    worker.catch_up = _timed(records, "catch_up", worker.catch_up, lambda a, k: None)
    return records, prof


def _force(model, force: tuple[int, ...]) -> None:
    """The adaptive cost model made to take the modes of `force` in turn, step by step."""
    # choose() runs more than once a step (the KV demand asks too): key the forced mode on the
    # steps observed so far.
    observe, done = model.observe, [0]

    def counted(*a, **k):
        done[0] += 1
        return observe(*a, **k)

    model.observe = counted
    model.choose = lambda n, catch_up=None: force[done[0] % len(force)]


def _generate(
    engine, batch: int, args: argparse.Namespace, records: list, prof: _StepProfiler
) -> dict:
    """A warm-up generation, then the timed one (profiled with --profile): its records alone
    kept, its tokens/s, its time split and allocator counters."""
    params = {"temperature": 1.0, "max_new_tokens": args.output_len, "ignore_eos": True}
    g = torch.Generator().manual_seed(0)
    info = engine.get_server_info
    for r in range(2):  # the first: warm-up
        records.clear()
        ids = torch.randint(
            5, args.vocab, (batch, args.input_len), generator=g, device="cpu"
        ).tolist()
        before = dict(info()["internal_states"][0].get("spec_time_breakdown", {}))
        mem = _memory()
        if r == 1 and args.profile:
            prof.arm()
        start = time.perf_counter()
        engine.generate(input_ids=ids, sampling_params=params)
        elapsed = time.perf_counter() - start
    mem = {k: v - mem.get(k, 0) for k, v in _memory().items()}
    after_s = info()["internal_states"][0].get("spec_time_breakdown", {})
    split = {k: round(1000 * (v - before.get(k, 0.0)), 1) for k, v in after_s.items()}
    return {
        "split_ms_total": split,
        "allocator": mem,
        "tokens_per_s": round(batch * args.output_len / elapsed, 1),
    }


def _summary(records: list) -> dict:
    """Median milliseconds per kind of step, and of speculative steps by the kind before."""
    summary = {}
    for kind in ("spec", "plain", "catch_up"):
        # (a catch-up with nothing to catch up returns at once: the one inside each decode)
        ms = [m for k, _, _, m in records if k == kind and (kind != "catch_up" or m > 0.1)]
        if ms:
            summary[kind] = {"n": len(ms), "median_ms": round(statistics.median(ms), 3)}
    # spec steps right after a plain step vs right after a spec step
    after = {"plain": [], "spec": []}
    prev = None
    for k, _, _, m in records:
        if k == "spec" and prev in after:
            after[prev].append(m)
        if k != "catch_up":
            prev = k
    summary["spec_after"] = {p: round(statistics.median(v), 3) for p, v in after.items() if v}
    return summary


def main(argv: Optional[list[str]] = None) -> None:
    args = parse_args(argv)
    target, draft = (
        os.path.dirname(glob.glob(os.path.join(args.work_dir, "*", role, "config.json"))[0])
        for role in ("llama", "eagle3")
    )
    chosen = {n: c for n, c in cases(draft).items() if not args.cases or n in args.cases}
    results, rounds = {}, {}
    for _ in range(args.rounds):
        for name, (kwargs, force) in chosen.items():
            result = _run(target, kwargs, args.batch, args, force)
            results.setdefault(name, result)
            rounds.setdefault(name, []).append(
                {"tokens_per_s": result["tokens_per_s"], "summary": result["summary"]}
            )
            print(name, result["tokens_per_s"], json.dumps(result["summary"]), flush=True)
            print(json.dumps(result["split_ms_total"]), result["allocator"], flush=True)
            if result["profile"]:
                print(result["profile"], flush=True)
    if args.rounds > 1:
        per_round = {k: [r["tokens_per_s"] for r in v] for k, v in rounds.items()}
        print("tokens/s per round:", json.dumps(per_round), flush=True)
    with open(args.json, "w") as f:
        json.dump(
            {
                "batch": args.batch,
                "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
                **results,
                "rounds": rounds,
            },
            f,
        )


def cases(draft: str) -> dict[str, tuple[dict, Optional[tuple[int, ...]]]]:
    """Each case's engine kwargs (`draft`: the EAGLE-3 draft's path) and the modes its adaptive
    engine is made to take in turn (None: its own choice)."""
    spec = dict(
        speculative_algorithm="EAGLE3",
        speculative_draft_model_path=draft,
        speculative_num_steps=3,
        speculative_eagle_topk=1,
        speculative_num_draft_tokens=4,
    )
    return {
        "fixed": (spec, None),
        "adaptive_forced_deepest": ({**spec, "speculative_adaptive": True}, (3,)),
        "adaptive_forced_plain_then_deepest": ({**spec, "speculative_adaptive": True}, (0, 3)),
        "adaptive_forced_plain": ({**spec, "speculative_adaptive": True}, (0,)),
        "adaptive_free": ({**spec, "speculative_adaptive": True}, None),
        "plain": ({}, None),
    }


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work-dir", default="/tmp/specrl-bench")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--attention-backend", default="flashinfer")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--context-length", type=int, default=512)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--vocab", type=int, default=8192, help="prompt token ids below this")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument(
        "--profile",
        choices=["torch", "python"],
        help="profile --profile-steps speculative steps of each case's timed generation",
    )
    parser.add_argument("--cases", nargs="+", help="only these cases")
    parser.add_argument("--profile-steps", type=int, default=10)
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run the cases this many times, alternating (an A/B on a machine whose speed "
        "drifts); the JSON keeps the first round's results and every round's tokens/s and "
        "step medians",
    )
    parser.add_argument("--json", required=True)
    args = parser.parse_args(argv)
    args.disable_cuda_graph = args.device != "cuda"  # what open_engine reads besides these flags
    args.enable_deterministic_inference = False
    return args


if __name__ == "__main__":
    main()
