"""Decode throughput of spec_engine against transformers `generate` on the same checkpoint.

    python -m scripts.bench_engine                       # random ~56M-parameter Llama, CPU
    python -m scripts.bench_engine --model-path DIR --device cuda --dtype bfloat16

For each batch size both engines generate greedily (EOS ignored) from the same random prompts.
Decode tokens/s = batch * (output_len - 1) / (time of the full generation - time of a
one-token generation), so prefill is not counted. Each time is the best of --repeats runs,
the two engines alternating, with fresh prompts per run so no prefix cache is hit.
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from collections.abc import Callable
from typing import Any, Optional

import torch

from bench.prompts import random_batches


def engine_runner(engine) -> Callable[[list[list[int]], int], None]:
    def run(prompts: list[list[int]], new_tokens: int) -> None:
        outs = engine.generate(
            input_ids=prompts,
            sampling_params={"temperature": 0.0, "max_new_tokens": new_tokens, "ignore_eos": True},
        )
        assert all(len(o["output_ids"]) == new_tokens for o in outs)

    return run


def hf_runner(model, device: torch.device) -> Callable[[list[list[int]], int], None]:
    @torch.inference_mode()
    def run(prompts: list[list[int]], new_tokens: int) -> None:
        ids = torch.tensor(prompts, device=device)
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=0,
        )
        assert out.shape[1] == ids.shape[1] + new_tokens

    return run


def decode_tok_s(
    runners: dict[str, Callable[[list[list[int]], int], None]],
    batch: int,
    args: argparse.Namespace,
    vocab: int,
) -> dict[str, float]:
    """Best-of-repeats decode tokens/s per runner; the runners alternate so drifts in machine
    speed hit both alike."""
    full: dict[str, list[float]] = {name: [] for name in runners}
    prefill: dict[str, list[float]] = {name: [] for name in runners}
    seed = batch * 10_000
    for _ in range(args.repeats):
        for name, run in runners.items():
            for new_tokens, times in ((args.output_len, full[name]), (1, prefill[name])):
                seed += 1
                prompts = random_batches(batch, args.input_len, vocab, seed)
                start = time.perf_counter()
                run(prompts, new_tokens)
                times.append(time.perf_counter() - start)
    return {
        name: batch * (args.output_len - 1) / max(min(full[name]) - min(prefill[name]), 1e-9)
        for name in runners
    }


def main(argv: Optional[list[str]] = None) -> None:
    args = parse_args(argv)
    from transformers import AutoModelForCausalLM

    from spec_engine import Engine

    path = args.model_path or random_llama(args)
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    params = sum(p.numel() for p in hf.parameters())
    vocab = hf.config.vocab_size
    engine = Engine(
        model_path=path,
        device=args.device,
        dtype=args.dtype,
        skip_tokenizer_init=True,
        random_seed=0,
        max_running_requests=max(args.batch_sizes),
        disable_radix_cache=True,
    )
    results = []
    try:
        for batch in args.batch_sizes:
            speeds = decode_tok_s(
                {"ours": engine_runner(engine), "hf": hf_runner(hf, device)}, batch, args, vocab
            )
            ours, theirs = speeds["ours"], speeds["hf"]
            results.append(
                {
                    "batch": batch,
                    "spec_engine_tok_s": round(ours, 1),
                    "transformers_tok_s": round(theirs, 1),
                    "speedup": round(ours / theirs, 2),
                }
            )
            print(json.dumps(results[-1]), flush=True)
    finally:
        engine.shutdown()
    report(results, params, args)


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_decode_flags(parser, batch_sizes=[1, 8, 32, 64], input_len=128, output_len=128, repeats=2)
    return parser.parse_args(argv)


def add_decode_flags(
    parser: argparse.ArgumentParser,
    batch_sizes: list[int],
    input_len: int,
    output_len: int,
    repeats: int,
) -> None:
    """The flags of a decode-throughput benchmark (`decode_tok_s` and `random_llama` read
    them), with these defaults."""
    parser.add_argument(
        "--model-path", help="checkpoint to use; default: build a random Llama (see --hidden-size)"
    )
    parser.add_argument("--hidden-size", type=int, default=512)
    parser.add_argument("--num-layers", type=int, default=8)
    parser.add_argument("--vocab-size", type=int, default=32000)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=batch_sizes)
    parser.add_argument("--input-len", type=int, default=input_len)
    parser.add_argument("--output-len", type=int, default=output_len)
    parser.add_argument("--repeats", type=int, default=repeats)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--json", help="also write the results to this JSON file")


def random_llama(args: argparse.Namespace) -> str:
    """A random Llama of the flags' shape, in a fresh temporary directory."""
    from tiny.checkpoints import build_checkpoint

    path = tempfile.mkdtemp(prefix="bench-llama-")
    build_checkpoint(
        path,
        arch="llama",
        vocab_size=args.vocab_size,
        hidden_size=args.hidden_size,
        intermediate_size=int(args.hidden_size * 2.75),
        num_layers=args.num_layers,
        num_heads=8,
        num_kv_heads=4,
        max_position_embeddings=2048,
        initializer_range=0.02,
    )
    return path


def report(results: list[dict], params: int, args: argparse.Namespace) -> None:
    """Print the table of both engines' decode rates per batch size; write --json."""
    print(
        f"\nmodel: {params / 1e6:.1f}M parameters, {args.dtype}, device {args.device} "
        f"({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads), "
        f"input {args.input_len}, output {args.output_len}, best of {args.repeats}"
    )
    print_table(
        ["batch", "spec_engine decode tok/s", "transformers decode tok/s", "speedup"],
        [
            [r["batch"], r["spec_engine_tok_s"], r["transformers_tok_s"], f"{r['speedup']}x"]
            for r in results
        ],
    )
    write_json(args.json, {"params": params, "args": vars(args), "results": results})


def print_table(header: list[str], rows: list[list[Any]]) -> None:
    """A Markdown table, numbers right-aligned."""
    print("| " + " | ".join(header) + " |")
    print("|" + "---:|" * len(header))
    for row in rows:
        print("| " + " | ".join(str(v) for v in row) + " |")


def write_json(path: Optional[str], data: dict) -> None:
    """`data` to `path` (the --json flag), if given."""
    if path:
        with open(path, "w") as f:
            json.dump(data, f, indent=2)


if __name__ == "__main__":
    main()
