"""Build the tiny CPU run's assets (specrl.tiny_run): a tokenizer, a random MiMo-style model, the
tiny task and a supervised warm-up; prints the warmed-up checkpoint's path.

    python -m scripts.prepare_tiny_run --out runs/tiny-cpu/assets
"""

from __future__ import annotations

import argparse

from specrl.console import quiet_known_noise, setup_logging
from specrl.tiny_run import prepare


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", required=True, help="Directory for base/, task.jsonl and warm/.")
    parser.add_argument("--steps", type=int, default=60, help="Supervised warm-up steps.")
    parser.add_argument("--response-len", type=int, default=4, help="Tokens per warm-up response.")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--drift-at",
        type=int,
        default=None,
        help="The drift task: from this prompt on, the rewarded letter shifts to the next one "
        "(rollout.tiny_task.write_tiny_task).",
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
        )
    )


if __name__ == "__main__":
    main()
