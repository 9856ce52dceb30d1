"""What EngineArgs' speculative flags accept: the algorithm, the flags that go with it, the
draft tree's and the NGRAM cache's sizes (check_speculative, when EngineArgs is built), and
--enable-multi-layer-eagle against the target's MTP layers (check_multi_layer_eagle, when
spec_engine.args.resolve has read the model); each error names the flag."""

from __future__ import annotations

from typing import Any, Optional

from spec_engine.args.engine_checks import check_choice, check_positive

SPECULATIVE_ALGORITHMS = ("EAGLE", "EAGLE3", "STANDALONE", "NGRAM")
# Flags that mean nothing without --speculative-algorithm.
NEEDS_ALGORITHM = (
    "speculative_draft_model_path",
    "speculative_num_steps",
    "speculative_eagle_topk",
    "speculative_num_draft_tokens",
    "speculative_token_map",
)
NGRAM_POSITIVE = (
    "speculative_ngram_min_match_window_size",
    "speculative_ngram_max_match_window_size",
    "speculative_ngram_min_bfs_breadth",
    "speculative_ngram_max_bfs_breadth",
    "speculative_ngram_branch_length",
    "speculative_ngram_capacity",
)


def canonical_algorithm(algorithm: Optional[str]) -> Optional[str]:
    """--speculative-algorithm in capitals, SGLang's NEXTN as the EAGLE it runs."""
    if algorithm is None:
        return None
    algorithm = algorithm.upper()
    return "EAGLE" if algorithm == "NEXTN" else algorithm


def check_speculative(args: Any) -> None:
    """The algorithm (canonical_algorithm's spelling) and the flags that go with it."""
    check_choice(
        "speculative_algorithm", args.speculative_algorithm, SPECULATIVE_ALGORITHMS, allow_none=True
    )
    check_adaptive(args)
    if args.speculative_algorithm is None:
        given = [f for f in NEEDS_ALGORITHM if getattr(args, f) is not None]
        if given:
            raise ValueError(f"--{given[0].replace('_', '-')} needs --speculative-algorithm")
        return
    for name in ("speculative_num_steps", "speculative_eagle_topk", "speculative_num_draft_tokens"):
        check_positive(name, getattr(args, name), allow_none=True)
    for name in ("speculative_accept_threshold_single", "speculative_accept_threshold_acc"):
        value = getattr(args, name)
        if not 0.0 < value <= 1.0:
            raise ValueError(
                f"--{name.replace('_', '-')} must be in (0, 1] (1.0 is lossless), got {value}"
            )
    check_ngram(args)
    if args.speculative_token_map is not None and args.speculative_algorithm != "EAGLE":
        raise ValueError(
            "--speculative-token-map (FR-Spec) works with --speculative-algorithm EAGLE only"
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
