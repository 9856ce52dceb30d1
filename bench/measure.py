"""One engine of the rollout benchmark: opening it, warming it up, and one timed round.

Shared by bench/rounds.py, which runs the engines in its own process, and
bench/isolate.py, which runs each in a process of its own.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from bench.prompts import prompts
from spec_engine.speculative.adaptive.costs import bucket

if TYPE_CHECKING:
    from spec_engine import Engine


def open_engine(path: str, kwargs: dict, batch: int, args: argparse.Namespace) -> Engine:
    from spec_engine import Engine

    return Engine(
        model_path=path,
        device=args.device,
        dtype=args.dtype,
        skip_tokenizer_init=True,
        random_seed=0,
        disable_radix_cache=True,
        disable_cuda_graph=args.disable_cuda_graph,
        enable_deterministic_inference=args.enable_deterministic_inference,
        attention_backend=args.attention_backend,
        context_length=args.context_length,
        # One engine per batch size: its KV cache and CUDA graphs sized for that batch alone, so
        # an 8B model's engines start in seconds and never hold more memory than they use.
        max_running_requests=batch,
        cuda_graph_bs=None if args.disable_cuda_graph else [batch],
        **kwargs,
    )


def sampling(args: argparse.Namespace) -> dict:
    temperature = 1.0 if args.forced_acceptance else 0.0
    return {"temperature": temperature, "max_new_tokens": args.output_len, "ignore_eos": True}


def warm_up(engine: Engine, batch: int, args: argparse.Namespace, repetitive: bool) -> None:
    """One untimed generation: graphs captured, caches grown, an adaptive cost model measured."""
    engine.generate(
        input_ids=prompts(batch, args.input_len, args.vocab_size, repetitive, 0),
        sampling_params=sampling(args),
    )


def measure(
    engine: Engine,
    batch: int,
    args: argparse.Namespace,
    repetitive: bool,
    r: int,
    clock: Callable[[], float] = time.perf_counter,
) -> dict:
    """Round `r`: a prefill-only run and a whole generation of `batch` prompts, timed by `clock`
    (bench_isolate.StepGate's: the engine's own steps alone), with the generation's accept
    length, time split and steps per mode."""
    params = sampling(args)
    prefill_s = timed(
        clock,
        engine.generate,
        input_ids=prompts(batch, args.input_len, args.vocab_size, repetitive, 1000 + r),
        sampling_params={**params, "max_new_tokens": 1},
    )
    worker = engine.scheduler.worker
    before = spec_time_breakdown(engine)
    modes_before = adaptive_steps(engine)
    steps_before = getattr(worker, "verify_steps", 0)
    verify_before, emitted_before = spec_counts(engine)
    start = clock()
    outs = engine.generate(
        input_ids=prompts(batch, args.input_len, args.vocab_size, repetitive, r + 1),
        sampling_params=params,
    )
    elapsed = clock() - start
    verify_ct, emitted_ct = spec_counts(engine)
    verifies, emitted = verify_ct - verify_before, emitted_ct - emitted_before
    steps = getattr(worker, "verify_steps", 0) - steps_before
    spent = {k: v - before.get(k, 0.0) for k, v in spec_time_breakdown(engine).items()}
    modes = {m: n - modes_before.get(m, 0) for m, n in adaptive_steps(engine).items()}
    decode_steps = sum(modes.values())
    state = {
        "accept_length": round(emitted / verifies, 3) if verifies else None,
        "ms_per_step": {k.removesuffix("_s"): round(1000 * v / steps, 2) for k, v in spent.items()}
        if steps
        else None,
        # --speculative-adaptive: the share of decode steps that speculated, and the steps run
        # per mode (0: plain, else the depth).
        "speculative_step_share": round(1 - modes[0] / decode_steps, 3) if decode_steps else None,
        "steps_by_depth": modes or None,
        # --speculative-adaptive: why it chose as it did (the fitted costs and accept lengths of
        # this batch's bucket, the generation's last steps as (mode, batch, ms))
        "cost_model": cost_model(engine, batch),
    }
    tokens = sum(len(o["output_ids"]) for o in outs)
    return {"prefill_s": prefill_s, "elapsed": elapsed, "tokens": tokens, "state": state}


def timed(clock: Callable[[], float], fn, *args, **kwargs) -> float:
    """Seconds `fn(*args, **kwargs)` takes by `clock`."""
    start = clock()
    fn(*args, **kwargs)
    return clock() - start


def spec_time_breakdown(engine: Engine) -> dict[str, float]:
    """Seconds drafting, verifying and in bookkeeping so far (none without speculation)."""
    return engine.get_server_info()["internal_states"][0].get("spec_time_breakdown", {})


def spec_counts(engine: Engine) -> tuple[int, int]:
    """Verify passes so far and the tokens they emitted (0, 0 without speculation)."""
    counters = getattr(engine.scheduler.policy, "counters", None)
    return (counters.verify_ct, counters.emitted) if counters is not None else (0, 0)


def adaptive_steps(engine: Engine) -> dict[int, int]:
    """Decode steps run so far per mode: 0 plain, else the speculative depth
    (--speculative-adaptive; else empty)."""
    report = engine.get_server_info()["internal_states"][0].get("spec_adaptive")
    return {0: report["plain_steps"], **report["steps_by_depth"]} if report else {}


def cost_model(engine: Engine, batch: int) -> dict | None:
    """--speculative-adaptive's state at `batch` (None without it): accept length per depth,
    the fitted seconds per request of each mode, and the latest steps."""
    report = engine.get_server_info()["internal_states"][0].get("spec_adaptive")
    if not report:
        return None
    return {
        "accept_length": report["accept_length"],
        "bucket": report["buckets"].get(bucket(batch)),
        "latest_steps": report["latest_steps"],
    }
