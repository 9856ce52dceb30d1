"""Command line: convert between Hugging Face directories and specrl's megatron checkpoints.

python -m trainer_bridge.convert hf-to-mcore --hf-checkpoint A --save B [--tp N] [--ep N] [--etp N]
python -m trainer_bridge.convert mcore-to-hf --load B --hf-checkpoint A --save C [--keep-fp8]

A block-FP8 Hugging Face checkpoint (DeepSeek-V3's release) is read dequantized; mcore-to-hf
writes it back in BF16, or with --keep-fp8 in its FP8 layout.

--tp, --ep and --etp also answer to Megatron's --tensor-model-parallel-size,
--expert-model-parallel-size and --expert-tensor-parallel-size; mcore-to-hf reads a checkpoint of
any TP, EP and expert TP size.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any, Optional

from trainer_bridge.convert.checkpoint import hf_to_mcore, mcore_to_hf
from trainer_bridge.model.provider import DEFAULT_VOCAB_DIVISOR


def main(argv: Optional[Sequence[str]] = None) -> None:
    """Run one conversion; a bad checkpoint or flag exits with status 2 and the reason."""
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        if args.command == "hf-to-mcore":
            hf_to_mcore(
                args.hf_checkpoint,
                args.save,
                tp=args.tp,
                make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
                ep=args.ep,
                expert_tp=args.etp,
            )
        else:
            mcore_to_hf(args.load, args.hf_checkpoint, args.save, keep_fp8=args.keep_fp8)
    except (ValueError, FileNotFoundError) as e:
        parser.exit(2, f"error: {e}\n")
    print(f"wrote {args.save}")


def _parser() -> argparse.ArgumentParser:
    """The command line: one subcommand per direction."""
    parser = argparse.ArgumentParser(
        prog="python -m trainer_bridge.convert",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = parser.add_subparsers(dest="command", required=True)
    _add_hf_to_mcore(commands)
    _add_mcore_to_hf(commands)
    return parser


def _add_hf_to_mcore(commands: Any) -> None:
    """hf-to-mcore's flags: where from and to, and the parallel layout to shard for."""
    to_mcore = commands.add_parser(
        "hf-to-mcore", help="Hugging Face directory -> megatron checkpoint"
    )
    to_mcore.add_argument(
        "--hf-checkpoint",
        required=True,
        help="Hugging Face directory (config.json + *.safetensors)",
    )
    to_mcore.add_argument("--save", required=True, help="output megatron checkpoint directory")
    to_mcore.add_argument(
        "--tp",
        "--tensor-model-parallel-size",
        dest="tp",
        type=int,
        default=1,
        help="tensor parallel size to shard for",
    )
    to_mcore.add_argument(
        "--ep",
        "--expert-model-parallel-size",
        dest="ep",
        type=int,
        default=1,
        help="expert parallel size to split MoE experts over (the training run's "
        "--expert-model-parallel-size)",
    )
    to_mcore.add_argument(
        "--etp",
        "--expert-tensor-parallel-size",
        dest="etp",
        type=int,
        default=None,
        help="expert tensor parallel size: --tp (the default) splits each routed expert over the "
        "tensor-parallel ranks, 1 gives every rank whole experts, a divisor of --tp in between "
        "splits each over that many (TP rank r holding slice r %% it; the training run's "
        "--expert-tensor-parallel-size)",
    )
    to_mcore.add_argument(
        "--make-vocab-size-divisible-by",
        type=int,
        default=DEFAULT_VOCAB_DIVISOR,
        help="pad the vocabulary to a multiple of this times --tp (Megatron's flag)",
    )


def _add_mcore_to_hf(commands: Any) -> None:
    """mcore-to-hf's flags: the megatron checkpoint, the Hugging Face directory it came from, and
    where to write."""
    to_hf = commands.add_parser("mcore-to-hf", help="megatron checkpoint -> Hugging Face directory")
    to_hf.add_argument(
        "--load", required=True, help="megatron checkpoint directory written by hf-to-mcore"
    )
    to_hf.add_argument(
        "--hf-checkpoint",
        required=True,
        help="the Hugging Face directory it came from (config and tokenizer files are copied)",
    )
    to_hf.add_argument("--save", required=True, help="output Hugging Face directory")
    to_hf.add_argument(
        "--keep-fp8",
        action="store_true",
        help="when --hf-checkpoint is block-FP8 (DeepSeek-V3's release), write its FP8 weights "
        "back in its layout (float8_e4m3fn + weight_scale_inv per weight_block_size block) "
        "instead of BF16",
    )


if __name__ == "__main__":
    main()
