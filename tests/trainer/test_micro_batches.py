"""Micro batches of a train step (trainer_bridge.micro_batches.plan): --micro-batch-size sequences
in order, or slime's --use-dynamic-batch-size: first fit within --max-tokens-per-gpu, as many micro
batches on every data-parallel rank."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trainer_bridge.micro_batches.plan import _cost, plan_micro_batches


def test_slimes_example_makes_two_micro_batches():
    """slime's --use-dynamic-batch-size help: lengths 100, 200, 300 and --max-tokens-per-gpu 300
    make the micro batches [100, 200] and [300]."""
    assert plan_micro_batches([0, 1, 2], [100, 200, 300], 4, max_tokens=300) == [[0, 1], [2]]


def test_padded_micro_batches_count_rows_times_the_longest():
    rows, lengths = [10, 11, 12], [300, 100, 100]
    assert plan_micro_batches(rows, lengths, 4, 400, packed=True) == [[10, 11], [12]]
    # padded, 300 + 100 costs 2 x 300 positions; the two short rows fit together
    assert plan_micro_batches(rows, lengths, 4, 400, packed=False) == [[10], [11, 12]]


def test_a_sequence_over_the_budget_runs_alone_and_the_fixed_size_keeps_the_order():
    assert plan_micro_batches([0, 1, 2], [500, 10, 20], 4, max_tokens=100) == [[0], [1, 2]]
    assert plan_micro_batches(range(3, 10), [1] * 7, 3) == [[3, 4, 5], [6, 7, 8], [9]]


def test_the_count_rises_to_the_largest_ranks_by_splitting_the_heaviest():
    # one micro batch of 24 tokens here; another rank has three
    got = plan_micro_batches(range(6), [5, 5, 5, 5, 3, 1], 8, 100, align=lambda n: 3)
    # 24 tokens -> 13 [0, 2, 4] + 11 [1, 3, 5] (longest first into the lighter half), then the
    # 13 -> 8 + 5
    assert got == [[0, 4], [2], [1, 3, 5]]
    with pytest.raises(ValueError, match="2 sequences cannot fill 3 micro batches"):
        plan_micro_batches([0, 1], [5, 5], 8, 100, align=lambda n: 3)


@settings(max_examples=200, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 64), min_size=1, max_size=24),
    budget=st.integers(1, 200),
    packed=st.booleans(),
    extra=st.integers(0, 24),
)
def test_every_sequence_lands_once_within_the_budget(lengths, budget, packed, extra):
    rows = [100 + i for i in range(len(lengths))]
    counts = []

    def align(count: int) -> int:
        counts.append(count)
        return min(count + extra, len(lengths))

    got = plan_micro_batches(rows, lengths, 1, budget, packed=packed, align=align)
    assert sorted(sum(got, [])) == rows
    assert len(got) == max(counts[0], min(counts[0] + extra, len(lengths)))
    for b in got:
        assert b == sorted(b)
        if len(b) > 1:  # only a sequence alone may exceed the budget
            assert _cost([r - 100 for r in b], lengths, packed) <= budget


def test_balance_data_gives_every_rank_as_many_sequences_and_close_token_counts():
    """GRPO groups of long and of short prompts: contiguous shares would give one rank 400 tokens
    and the other 40; --balance-data gives each two of each."""
    from trainer_bridge.parallel.data import balanced_partitions

    assert balanced_partitions([100] * 4 + [10] * 4, 2) == [[0, 3, 5, 6], [1, 2, 4, 7]]
    assert balanced_partitions([1, 2, 3, 4, 5, 6, 7, 8], 2) == [[0, 3, 5, 6], [1, 2, 4, 7]]
    with pytest.raises(ValueError, match="7 sequences do not split into 2 equal groups"):
        balanced_partitions([1] * 7, 2)


@settings(max_examples=200, deadline=None)
@given(
    parts=st.integers(1, 4),
    per=st.integers(1, 6),
    data=st.data(),
)
def test_balanced_partitions_split_every_sequence_once_into_equal_groups(parts, per, data):
    from trainer_bridge.parallel.data import balanced_partitions

    lengths = data.draw(st.lists(st.integers(1, 500), min_size=parts * per, max_size=parts * per))
    got = balanced_partitions(lengths, parts)
    assert len(got) == parts and all(len(g) == per and g == sorted(g) for g in got)
    assert sorted(sum(got, [])) == list(range(len(lengths)))
    sums = [sum(lengths[i] for i in g) for g in got]
    # within one longest sequence of each other (largest differencing keeps each merge's spread
    # under the larger of the two it merges)
    assert max(sums) - min(sums) <= max(lengths)
