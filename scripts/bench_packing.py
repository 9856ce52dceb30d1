"""One trainer train step with and without sequence packing (--qkv-format thd vs bshd), CPU.

    python -m scripts.bench_packing --repeats 15 --json docs/benchmarks/packing_cpu.json

The tiny CPU run's trainer (specrl.tiny_run: a random Qwen2 trunk, hidden 64, 2 layers, one
MiMo MTP layer) takes TrainActor.train on 32 sequences in one micro batch (--micro-batch-size 32,
GRPO, --enable-mtp-training): the old log-probs forward, forward + backward with the MTP loss,
one Adam step. Two batches: the tiny run's shapes (its task's prompts, 1-4 response tokens) and
ragged ones (prompts of 16-128 tokens, responses of 1-128). The two layouts alternate on one
actor and each time is the best of --repeats: the machine is shared and noisy.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
import time

from rollout.tiny_task import PROMPT_FORMAT
from specrl.tiny_models import add_mimo_mtp, build_tiny_model
from trainer_bridge.batch import TrainBatch

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


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=7, help="Train steps per layout and batch.")
    parser.add_argument("--json", default=None, help="Also write the results here.")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch CPU threads. One by default: on a shared 2-vCPU machine two threads "
        "contend with other processes and one step's time varies tenfold.",
    )
    args = parser.parse_args()

    import torch

    torch.set_num_threads(args.threads)

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
    actor = TrainActor(trainer)
    rng = random.Random(0)
    batches = {
        "tiny run": tiny_batch(tokenizer, rng),
        "ragged": ragged_batch(len(tokenizer), rng),
    }
    results = []
    for name, batch in batches.items():
        real = sum(len(t) for t in batch.tokens)
        padded = len(batch) * max(len(t) for t in batch.tokens)
        times: dict[str, list[float]] = {"bshd": [], "thd": []}
        for _ in range(args.repeats + 1):  # the first round warms up both layouts
            for layout in times:
                actor.args.qkv_format = layout
                start = time.perf_counter()
                actor.train(batch)
                times[layout].append(time.perf_counter() - start)
        best = {layout: min(t[1:]) for layout, t in times.items()}
        results.append(
            dict(
                batch=name,
                tokens=real,
                padded_tokens=padded,
                **{f"{k}_s": v for k, v in best.items()},
            )
        )
        print(
            f"{name}: {real} tokens ({padded} padded): bshd {best['bshd']:.3f} s, "
            f"thd {best['thd']:.3f} s, speed-up {best['bshd'] / best['thd']:.2f}x",
            flush=True,
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
