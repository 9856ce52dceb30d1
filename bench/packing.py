"""One trainer train step with and without sequence packing (--qkv-format thd vs bshd), CPU.

    python -m scripts.bench_packing --repeats 15 --json docs/benchmarks/data/packing_cpu.json

The tiny CPU run's trainer (tiny.run_assets: a random Qwen2 trunk, hidden 64, 2 layers, one
MiMo MTP layer) takes TrainActor.train on 32 sequences (GRPO, --enable-mtp-training): the old
log-probs forward, forward + backward with the MTP loss, one Adam step. Two batches: the tiny
run's shapes (its task's prompts, 1-4 response tokens) and ragged ones (prompts of 16-128
tokens, responses of 1-128). Two ways to size micro batches:

* the tiny run's: all 32 sequences in one micro batch (--micro-batch-size 32), padded or packed;
* a token budget per micro batch (--budget B positions, as a GPU's memory sets one): padded with
  the largest fixed --micro-batch-size whose micro batches never exceed it (B // the longest
  sequence), padded with --use-dynamic-batch-size --max-tokens-per-gpu B (rows x longest row
  within B), and packed with the same flags (tokens within B).

The configurations alternate on one actor; each time is the best of --repeats (the machine is
shared and noisy), and each ratio the median over rounds of the paired ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import time
from typing import TYPE_CHECKING, Any, Optional

from rollout.tiny_task import PROMPT_FORMAT
from tiny.checkpoints import add_mimo_mtp, build_tiny_model
from trainer_bridge.batch import TrainBatch

if TYPE_CHECKING:
    from trainer_bridge.actor import TrainActor

SAMPLES = 32


def tiny_batch(tokenizer, rng: random.Random) -> TrainBatch:
    """The tiny run's rollout: 4 prompts x 8 samples, responses of up to 4 tokens (EOS may end
    one early)."""
    letters = rng.sample("abcdefghij", 4)
    tokens, lengths = [], []
    for i in range(SAMPLES):
        prompt = tokenizer(PROMPT_FORMAT.format(letter=letters[i // 8]))["input_ids"]
        n = rng.randint(1, 4)
        tokens.append(prompt + [rng.randrange(5, len(tokenizer)) for _ in range(n)])
        lengths.append(n)
    return TrainBatch(
        tokens, lengths, [float(rng.random() < 0.5) for _ in range(SAMPLES)], n_samples_per_prompt=8
    )


def ragged_batch(vocab: int, rng: random.Random) -> TrainBatch:
    tokens, lengths = [], []
    for _ in range(SAMPLES):
        prompt, n = rng.randint(16, 128), rng.randint(1, 128)
        tokens.append([rng.randrange(5, vocab) for _ in range(prompt + n)])
        lengths.append(n)
    return TrainBatch(
        tokens, lengths, [float(rng.random() < 0.5) for _ in range(SAMPLES)], n_samples_per_prompt=8
    )


def configurations(batch: TrainBatch, budget: int) -> dict[str, tuple[dict, str]]:
    """name -> (the trainer options it sets, the padded configuration it is compared with)."""
    whole = "bshd, --micro-batch-size 32"
    fixed = f"bshd, --micro-batch-size {max(1, budget // max(len(t) for t in batch.tokens))}"
    dynamic = dict(use_dynamic_batch_size=True, max_tokens_per_gpu=budget)
    return {
        whole: (dict(qkv_format="bshd", micro_batch_size=SAMPLES), whole),
        "thd, --micro-batch-size 32": (dict(qkv_format="thd", micro_batch_size=SAMPLES), whole),
        fixed: (dict(qkv_format="bshd", micro_batch_size=int(fixed.split()[-1])), fixed),
        f"bshd, --max-tokens-per-gpu {budget}": (dict(qkv_format="bshd", **dynamic), fixed),
        f"thd, --max-tokens-per-gpu {budget}": (dict(qkv_format="thd", **dynamic), fixed),
    }


def time_step(actor, batch: TrainBatch, options: dict) -> tuple[float, int]:
    """(seconds, micro batches) of one train step under `options`."""
    defaults = dict(
        micro_batch_size=SAMPLES,
        use_dynamic_batch_size=False,
        max_tokens_per_gpu=None,
        log_probs_max_tokens_per_gpu=None,
    )
    settings = {**defaults, **options}
    settings["log_probs_max_tokens_per_gpu"] = settings["max_tokens_per_gpu"]
    for key, value in settings.items():
        setattr(actor.args, key, value)
    count = len(actor._micro_batches(range(len(batch)), [len(t) for t in batch.tokens]))
    start = time.perf_counter()
    actor.train(batch)
    return time.perf_counter() - start, count


def main(argv: Optional[list[str]] = None) -> None:
    args = parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    actor, tokenizer = build_actor()
    rng = random.Random(0)
    batches = {
        "tiny run": tiny_batch(tokenizer, rng),
        "ragged": ragged_batch(len(tokenizer), rng),
    }
    budgets = dict(zip(("tiny run", "ragged"), args.budget))
    results = []
    for name in args.batches:
        batch = batches[name]
        configs = configurations(batch, budgets[name])
        times, counts = time_configurations(actor, batch, configs, args.repeats)
        results += compare(name, batch, configs, times, counts)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=7, help="Train steps per layout and batch.")
    parser.add_argument(
        "--budget",
        type=int,
        nargs=2,
        default=[64, 1024],
        metavar=("TINY", "RAGGED"),
        help="Positions per micro batch for the token-budget configurations, per batch.",
    )
    parser.add_argument(
        "--batches", nargs="+", default=["tiny run", "ragged"], choices=["tiny run", "ragged"]
    )
    parser.add_argument("--json", default=None, help="Also write the results here.")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch CPU threads. One by default: on a shared 2-vCPU machine two threads "
        "contend with other processes and one step's time varies tenfold.",
    )
    return parser.parse_args(argv)


def build_actor() -> tuple[TrainActor, Any]:
    """The tiny run's trainer on a fresh random model, and the model's tokenizer."""
    from transformers import AutoTokenizer

    from trainer_bridge.actor import TrainActor
    from trainer_bridge.megatron_compat import filter_known_warnings
    from trainer_bridge.options import TrainerArgs

    filter_known_warnings()
    model = os.path.join(tempfile.mkdtemp(prefix="bench_packing_"), "base")
    build_tiny_model(model, arch="qwen2", num_layers=2, seed=0)
    add_mimo_mtp(model, seed=1)
    tokenizer = AutoTokenizer.from_pretrained(model)
    # Built packed: its attention runs megatron's own padded code when given no packed_seq_params,
    # so one actor times both layouts on the same weights.
    trainer = TrainerArgs(
        hf_checkpoint=model,
        lr=2e-3,
        micro_batch_size=SAMPLES,
        enable_mtp_training=True,
        qkv_format="thd",
    )
    return TrainActor(trainer), tokenizer


def time_configurations(
    actor: TrainActor, batch: TrainBatch, configs: dict[str, tuple[dict, str]], repeats: int
) -> tuple[dict[str, list[float]], dict[str, int]]:
    """Each configuration's seconds per round (the first a warm-up), the configurations taking
    turns within a round, and its number of micro batches."""
    times: dict[str, list[float]] = {c: [] for c in configs}
    counts: dict[str, int] = {}
    for _ in range(repeats + 1):  # the first round warms up every configuration
        for config, (options, _) in configs.items():
            seconds, counts[config] = time_step(actor, batch, options)
            times[config].append(seconds)
    return times, counts


def compare(
    name: str,
    batch: TrainBatch,
    configs: dict[str, tuple[dict, str]],
    times: dict[str, list[float]],
    counts: dict[str, int],
) -> list[dict]:
    """One row per configuration: its best and median time after the warm-up, and the median of
    its paired ratios to the configuration it is compared with (printed as well)."""
    real = sum(len(t) for t in batch.tokens)
    padded = len(batch) * max(len(t) for t in batch.tokens)
    print(f"{name}: {real} tokens ({padded} padded)", flush=True)
    rows = []
    for config, t in times.items():
        against = configs[config][1]
        ratios = [a / b for a, b in zip(times[against][1:], t[1:])]
        ratio = statistics.median(ratios)
        rows.append(
            dict(
                batch=name,
                tokens=real,
                padded_tokens=padded,
                config=config,
                micro_batches=counts[config],
                best_s=min(t[1:]),
                median_s=statistics.median(t[1:]),
                speedup_vs=against,
                speedup=ratio,
                rounds_faster=sum(r > 1 for r in ratios),
                rounds=len(ratios),
            )
        )
        print(
            f"  {config}: {counts[config]} micro batches, best {min(t[1:]):.4f} s, "
            f"{ratio:.2f}x against {against} (faster in {sum(r > 1 for r in ratios)} of "
            f"{len(ratios)} rounds)",
            flush=True,
        )
    return rows


if __name__ == "__main__":
    main()
