"""Build the tiny CPU run's assets (tiny.run_assets): a tokenizer, a random model with one MTP
layer (MiMo-style, or DeepSeek-V3- or GLM-4.5-shaped with --model deepseek-v3|glm4.5), the tiny
task and a supervised warm-up; prints the warmed-up checkpoint's path.

    python -m scripts.prepare_tiny_run --out runs/tiny-cpu/assets [--model deepseek-v3|glm4.5]
"""

from __future__ import annotations

import argparse

from specrl.console import quiet_known_noise, setup_logging
from tiny.run_assets import MODELS, prepare


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", required=True, help="Directory for base/, task.jsonl and warm/.")
    parser.add_argument("--steps", type=int, default=60, help="Supervised warm-up steps.")
    parser.add_argument("--response-len", type=int, default=4, help="Tokens per warm-up response.")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", choices=sorted(MODELS), default="mimo", help="Model family.")
    parser.add_argument(
        "--mtp-warmup",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="Train the MTP layer in the warm-up too (--no-mtp-warmup: it stays random, for "
        "online MTP training to teach).",
    )
    parser.add_argument(
        "--drift-at",
        type=int,
        default=None,
        help="The drift task: from this prompt on, the rewarded letter shifts to the next one "
        "(rollout.tiny_task.write_tiny_task).",
    )
    parser.add_argument(
        "--long-tail",
        action="store_true",
        help="The long-tailed task: each prompt also asks for a response length drawn from a "
        "Pareto distribution (rollout.tiny_task.long_tail_lengths).",
    )
    args = parser.parse_args()
    setup_logging()
    quiet_known_noise()
    print(
        prepare(
            args.out,
            steps=args.steps,
            response_len=args.response_len,
            seed=args.seed,
            drift_at=args.drift_at,
            model=args.model,
            warm_mtp=args.mtp_warmup,
            long_tail=args.long_tail,
        )
    )


if __name__ == "__main__":
    main()
