"""Checks of EngineArgs' NGRAM and --speculative-adaptive options (split from engine_args to
keep that module small); each error names the flag."""

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
    """--speculative-adaptive switches per step between speculating and plain decoding, which
    only a draft without state allows (NGRAM)."""
    if not args.speculative_adaptive:
        return
    if args.speculative_algorithm is None:
        raise ValueError(
            "--speculative-adaptive needs --speculative-algorithm NGRAM (it chooses per step "
            "between speculating and plain decoding)"
        )
    if args.speculative_algorithm != "NGRAM":
        raise ValueError(
            "--speculative-adaptive supports --speculative-algorithm NGRAM only, got "
            f"{args.speculative_algorithm}: EAGLE (EAGLE-2, MTP), EAGLE3 and STANDALONE drafts "
            "keep state (draft KV, the target's features) that a plain decode step does not "
            "advance, so switching per step is not implemented for them yet"
        )
