"""Build a tiny random Hugging Face checkpoint and a locally trained tokenizer (no hub access).

    python scripts/make_tiny_model.py --out /tmp/tiny-llama [--arch llama|qwen2|...|deepseek_v3]

The builders live in `tiny.checkpoints` (tests and examples use them too).
"""

from __future__ import annotations

import argparse

from tiny.checkpoints import build_tiny_model


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument(
        "--arch", default="llama", choices=["llama", "qwen2", "qwen3", "glm4_moe", "deepseek_v3"]
    )
    parser.add_argument("--hidden-size", type=int, default=64)
    parser.add_argument("--num-layers", type=int, default=2)
    parser.add_argument("--vocab-size", type=int, default=512)
    args = parser.parse_args()
    build_tiny_model(
        args.out,
        arch=args.arch,
        hidden_size=args.hidden_size,
        num_layers=args.num_layers,
        vocab_size=args.vocab_size,
        intermediate_size=2 * args.hidden_size,
    )
    print(f"wrote {args.arch} checkpoint and tokenizer to {args.out}")


if __name__ == "__main__":
    main()
