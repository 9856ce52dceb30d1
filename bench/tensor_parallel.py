"""Decode throughput of one engine at several --tp-size values on the same checkpoint.

    python -m scripts.bench_tp                                   # random ~56M Llama, CPU, tp 1 2
    python -m scripts.bench_tp --model-path DIR --device cuda --dtype bfloat16 \
        --tp-sizes 1 2 4 8 --batch-sizes 1 8 32 64 --disable-cuda-graph

Each --tp-size builds its engine (ranks 1.. spawned, on GPUs --base-gpu-id + r on CUDA),
measures every batch size, and shuts down before the next size starts: the sizes run one after
the other, never side by side. Decode tokens/s as bench/engine.py counts them: batch *
(output_len - 1) / (time of the full generation - time of a one-token generation), best of
--repeats, fresh random prompts per run (no prefix-cache hits). On the CPU the spawned ranks
get cpu_count // tp_size threads each; rank 0 keeps the caller's.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
from typing import Optional

import torch

from bench.engine import (
    add_decode_flags,
    decode_tok_s,
    engine_runner,
    print_table,
    random_llama,
    write_json,
)


def main(argv: Optional[list[str]] = None) -> None:
    args = parse_args(argv)
    from spec_engine import Engine
    from spec_engine.models.hf_config import ModelConfig

    path = args.model_path or random_llama(args)
    config = ModelConfig.from_pretrained(path)
    results = []
    for tp in args.tp_sizes:
        engine = Engine(
            model_path=path,
            tp_size=tp,
            device=args.device,
            dtype=args.dtype,
            skip_tokenizer_init=True,
            random_seed=0,
            max_running_requests=max(args.batch_sizes),
            disable_radix_cache=True,
            disable_cuda_graph=args.disable_cuda_graph,
            log_level="warning",
        )
        try:
            for batch in args.batch_sizes:
                speed = decode_tok_s(
                    {"engine": engine_runner(engine)}, batch, args, config.vocab_size
                )
                results.append(
                    {"tp_size": tp, "batch": batch, "decode_tok_s": round(speed["engine"], 1)}
                )
                print(json.dumps(results[-1]), flush=True)
        finally:
            engine.shutdown()
    report(results, path, args)


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_decode_flags(parser, batch_sizes=[1, 8], input_len=64, output_len=32, repeats=3)
    parser.add_argument("--tp-sizes", type=int, nargs="+", default=[1, 2])
    parser.add_argument(
        "--disable-cuda-graph",
        action="store_true",
        help="eager forwards at every size: CUDA needs it at --tp-size > 1, and tp 1 is then "
        "measured alike",
    )
    return parser.parse_args(argv)


def report(results: list[dict], path: str, args: argparse.Namespace) -> None:
    """Print decode tokens/s per tp size and batch, and each against tp 1; write --json."""
    base = {r["batch"]: r["decode_tok_s"] for r in results if r["tp_size"] == args.tp_sizes[0]}
    for r in results:
        r[f"vs_tp{args.tp_sizes[0]}"] = round(r["decode_tok_s"] / base[r["batch"]], 2)
    machine = {
        "device": args.device,
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "rank0_threads": torch.get_num_threads(),
        "gpus": torch.cuda.device_count() if torch.cuda.is_available() else 0,
    }
    print(
        f"\nmodel {path}, {args.dtype}, {machine}, input {args.input_len}, output "
        f"{args.output_len}, best of {args.repeats}"
    )
    first = f"vs_tp{args.tp_sizes[0]}"
    print_table(
        ["tp", "batch", "decode tok/s", f"vs tp {args.tp_sizes[0]}"],
        [[r["tp_size"], r["batch"], r["decode_tok_s"], f"{r[first]}x"] for r in results],
    )
    write_json(args.json, {"machine": machine, "args": vars(args), "results": results})


if __name__ == "__main__":
    main()
