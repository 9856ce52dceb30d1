"""Checks of EngineArgs' NGRAM, --speculative-adaptive and --enable-multi-layer-eagle options
(split from engine_args to keep that module small); each error names the flag."""

from __future__ import annotations

from typing import Any

NGRAM_POSITIVE = (
    "speculative_ngram_min_match_window_size",
    "speculative_ngram_max_match_window_size",
    "speculative_ngram_min_bfs_breadth",
    "speculative_ngram_max_bfs_breadth",
    "speculative_ngram_branch_length",
    "speculative_ngram_capacity",
)


def check_ngram(args: Any) -> None:
    """The NGRAM cache's sizes: positive, windows and breadths ordered, branches longer than the
    longest window."""
    for name in NGRAM_POSITIVE:
        value = getattr(args, name)
        if value is None or value <= 0:
            raise ValueError(
                f"--{name.replace('_', '-')} must be a positive integer, got {value!r}"
            )
    if args.speculative_ngram_min_match_window_size > args.speculative_ngram_max_match_window_size:
        raise ValueError(
            "--speculative-ngram-min-match-window-size exceeds "
            "--speculative-ngram-max-match-window-size"
        )
    if args.speculative_ngram_min_bfs_breadth > args.speculative_ngram_max_bfs_breadth:
        raise ValueError(
            "--speculative-ngram-min-bfs-breadth exceeds --speculative-ngram-max-bfs-breadth"
        )
    if args.speculative_ngram_max_match_window_size >= args.speculative_ngram_branch_length:
        raise ValueError(
            "--speculative-ngram-branch-length must exceed "
            "--speculative-ngram-max-match-window-size "
            f"({args.speculative_ngram_branch_length} <= "
            f"{args.speculative_ngram_max_match_window_size})"
        )


def check_adaptive(args: Any) -> None:
    """--speculative-adaptive switches per step between speculating and plain decoding: it
    needs an algorithm to speculate with (any: the draft-model workers keep their draft in step
    during plain steps)."""
    if args.speculative_adaptive and args.speculative_algorithm is None:
        raise ValueError(
            "--speculative-adaptive needs --speculative-algorithm (EAGLE, EAGLE3, NEXTN, "
            "STANDALONE or NGRAM): it chooses per step between speculating and plain decoding"
        )


def check_multi_layer_eagle(
    args: Any, multi_layer_mtp: bool, num_mtp_layers: int, steps: int, topk: int
) -> None:
    """--enable-multi-layer-eagle needs an MTP draft whose module runs several layers
    (`multi_layer_mtp`), a chain (SGLang's multi-layer worker drafts top-1 per layer) and no
    more steps than layers (step k runs layer k)."""
    if not args.enable_multi_layer_eagle:
        return
    if args.speculative_algorithm is None or args.speculative_draft_model_path is not None:
        raise ValueError(
            "--enable-multi-layer-eagle drafts with the target's MTP layers: use it with "
            "--speculative-algorithm EAGLE or NEXTN and no --speculative-draft-model-path"
        )
    if not multi_layer_mtp:
        raise ValueError(
            "--enable-multi-layer-eagle is implemented for DeepSeek-V3 MTP layers only; drop it "
            "(every draft step then runs the first MTP layer)"
        )
    if topk != 1:
        raise ValueError(
            f"--enable-multi-layer-eagle drafts a chain (one token per MTP layer); set "
            f"--speculative-eagle-topk 1, not {topk}"
        )
    if steps > num_mtp_layers:
        raise ValueError(
            f"--enable-multi-layer-eagle runs MTP layer k at draft step k, and the target has "
            f"{num_mtp_layers} (num_nextn_predict_layers): lower --speculative-num-steps {steps} "
            f"to at most {num_mtp_layers}, or drop the flag to run layer 0 at every step"
        )
