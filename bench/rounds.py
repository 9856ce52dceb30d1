"""The rollout benchmark's rounds: each configuration's engine warmed up, then measured round
after round (one engine at a time, all side by side, or each in a fresh process every round),
and its best round summarized."""

from __future__ import annotations

import argparse
import contextlib
import gc

import torch

from bench.isolate import EngineProcess, drive
from bench.measure import measure, open_engine, warm_up


def summarize(batch: int, rounds: list[dict], weight_bytes: int) -> dict:
    """Tokens/s of the best round, with and without prefill (the fastest prefill-only run)."""
    best = min(rounds, key=lambda m: m["elapsed"])
    decode_s = max(best["elapsed"] - min(m["prefill_s"] for m in rounds), 1e-9)
    return {
        "batch": batch,
        "tokens_per_s": round(best["tokens"] / best["elapsed"], 1),
        # The first token of each request comes with the prefill.
        "decode_tokens_per_s": round((best["tokens"] - batch) / decode_s, 1),
        "weight_bytes": weight_bytes,
        # every round's, in order: round r of each configuration ran side by side under --interleave
        "round_tokens_per_s": [round(m["tokens"] / m["elapsed"], 1) for m in rounds],
        # --lockstep: the same by the scheduler thread's CPU clock (bench/isolate.StepGate)
        **(
            {"round_tokens_per_cpu_s": [round(m["tokens"] / m["cpu_elapsed"], 1) for m in rounds]}
            if all("cpu_elapsed" in m for m in rounds)
            else {}
        ),
        **best["state"],
    }


def run(
    table: dict[str, tuple[str, dict]], names: list[str], batch: int, args: argparse.Namespace
) -> dict[str, dict]:
    """Each configuration in `names` at `batch`: after one warm-up generation, the best of
    --repeats rounds. --interleave: all engines open at once and the rounds go round-robin over
    them (starting one further each round), so a slow spell of the machine hits every
    configuration alike; --isolate: the same rounds, each engine in a fresh process every round
    (--lockstep: measured at once, a step each in turn); else one engine at a time."""
    if args.isolate or args.lockstep:
        return run_isolated(table, names, batch, args)
    groups = [names] if args.interleave else [[name] for name in names]
    out = {}
    for group in groups:
        with contextlib.ExitStack() as stack:
            engines = {n: stack.enter_context(open_engine(*table[n], batch, args)) for n in group}
            for n, engine in engines.items():
                warm_up(engine, batch, args, n.startswith("ngram"))
            rounds: dict[str, list[dict]] = {n: [] for n in group}
            for r in range(args.repeats):
                for n in turned(group, r):
                    rounds[n].append(measure(engines[n], batch, args, n.startswith("ngram"), r))
            for n, engine in engines.items():
                out[n] = summarize(batch, rounds[n], engine.runner.weight_bytes())
        del engines
        # The next engine's KV cache is sized from free device memory: release this one's first.
        gc.collect()
        if args.device == "cuda":
            torch.cuda.empty_cache()
    return out


def run_isolated(
    table: dict[str, tuple[str, dict]], names: list[str], batch: int, args: argparse.Namespace
) -> dict[str, dict]:
    """--isolate: round by round, each configuration's engine opened in a fresh process, warmed
    up, measured once and closed; --lockstep: every configuration's fresh engine of the round
    opened and warmed up, then all measured at once, one scheduler step each in turn, each timing
    its own steps (bench/isolate.py says why)."""
    rounds: dict[str, list[dict]] = {n: [] for n in names}
    weight_bytes = {}
    call = "measure_gated" if args.lockstep else "measure"
    for r in range(args.repeats):
        order = turned(names, r)
        for group in [order] if args.lockstep else [[n] for n in order]:
            with contextlib.ExitStack() as stack:
                engines = {
                    n: stack.enter_context(
                        EngineProcess(
                            *table[n],
                            batch,
                            args,
                            gated=args.lockstep,
                            in_process=getattr(args, "in_process", False),
                        )
                    )
                    for n in group
                }
                for n, engine in engines.items():
                    engine.call("warm_up", n.startswith("ngram"))
                    weight_bytes[n] = engine.weight_bytes
                for n, engine in engines.items():
                    engine.send(call, n.startswith("ngram"), r)
                answers = (
                    drive(engines) if args.lockstep else {n: e.answer() for n, e in engines.items()}
                )
                for n, result in answers.items():
                    rounds[n].append(result)
    return {n: summarize(batch, rounds[n], weight_bytes[n]) for n in names}


def turned(names: list[str], r: int) -> list[str]:
    """Round `r`'s order: turned by one each round, so no configuration always runs right after
    the same one (an adaptive engine after its slow fixed speculation)."""
    return names[r % len(names) :] + names[: r % len(names)]
