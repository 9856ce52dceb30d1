"""Which sequences each micro batch holds: --micro-batch-size of them in order, or (slime's
--use-dynamic-batch-size) as many as fit a token budget (--max-tokens-per-gpu).

The dynamic plan is slime's per-rank scheme (before its May 2026 rewrite, which plans a whole
step before dealing micro batches to ranks): first fit in the sequences' order within this rank's
share (slime's first_fit_pack), a sequence counting its prompt and response tokens; one longer
than the budget gets a micro batch of its own. Every data-parallel rank must run as many micro
batches (MoE layers exchange tokens over the expert group in each forward), so the count is raised
to the largest rank's (slime: an all-reduce MAX) by splitting the heaviest micro batch in two,
longest sequence first into the lighter half (slime's expand_bins_by_splitting), until it is
reached. Packed (thd), a micro batch costs its tokens; padded (bshd), its rows times its longest
row, the positions the model computes (the trainer pads each micro batch to its own longest).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Optional


def plan_micro_batches(
    rows: Sequence[int],
    lengths: Sequence[int],
    micro_batch_size: int,
    max_tokens: Optional[int] = None,
    packed: bool = True,
    align: Callable[[int], int] = lambda count: count,
) -> list[list[int]]:
    """`rows` (sequence i of length lengths[i]) in micro batches: micro_batch_size rows in order,
    or, with `max_tokens`, first fit within that budget, as many micro batches as
    `align(count)` (the data-parallel ranks' largest count)."""
    if len(rows) != len(lengths):
        raise ValueError(f"{len(rows)} rows but {len(lengths)} lengths")
    if max_tokens is None:
        return [list(rows[i : i + micro_batch_size]) for i in range(0, len(rows), micro_batch_size)]
    bins = _first_fit(lengths, max_tokens, packed)
    bins = _split_to(bins, lengths, align(len(bins)), packed)
    return [[rows[i] for i in b] for b in bins]


def _cost(members: Sequence[int], lengths: Sequence[int], packed: bool) -> int:
    """Positions the model computes for these sequences in one micro batch."""
    if packed:
        return sum(lengths[i] for i in members)
    return len(members) * max(lengths[i] for i in members)


def _first_fit(lengths: Sequence[int], max_tokens: int, packed: bool) -> list[list[int]]:
    bins: list[list[int]] = []
    sums: list[int] = []  # each bin's tokens, and its longest sequence: its cost in O(1)
    longest: list[int] = []
    for i, n in enumerate(lengths):
        for j, b in enumerate(bins):
            cost = sums[j] + n if packed else (len(b) + 1) * max(longest[j], n)
            if cost <= max_tokens:
                b.append(i)
                sums[j] += n
                longest[j] = max(longest[j], n)
                break
        else:
            bins.append([i])
            sums.append(n)
            longest.append(n)
    return bins


def _split_to(
    bins: list[list[int]], lengths: Sequence[int], count: int, packed: bool
) -> list[list[int]]:
    """`bins` split until there are `count`: the costliest bin of two or more sequences each
    time, its sequences longest first into the lighter half."""
    bins = [list(b) for b in bins]
    while len(bins) < count:
        splittable = [b for b in bins if len(b) > 1]
        if not splittable:
            raise ValueError(
                f"{sum(map(len, bins))} sequences cannot fill {count} micro batches: every "
                "data-parallel rank needs at least as many sequences per step as the largest "
                "rank's micro batches"
            )
        heaviest = max(splittable, key=lambda b: _cost(b, lengths, packed))
        halves: tuple[list[int], list[int]] = ([], [])
        for i in sorted(heaviest, key=lambda i: -lengths[i]):
            lighter = min(halves, key=lambda h: (_cost(h, lengths, packed) if h else 0, len(h)))
            lighter.append(i)
        at = bins.index(heaviest)
        bins[at : at + 1] = [sorted(halves[0]), sorted(halves[1])]
    return bins
