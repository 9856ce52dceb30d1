"""What each rank holds: attention heads, vocabulary rows, features of a split linear, routed
experts.

SGLang's and nano-vllm's rules: query heads and MLP features split evenly; KV heads split while
there are at least as many as ranks, and past that each KV head is replicated on
tp_size / num_kv_heads consecutive ranks (rank r holds KV head r // replicas); the vocabulary is
split in equal blocks of ceil(vocab / tp_size) rows, the last one short (its padding rows are
never looked up and their logits are cut after the gather). Routed experts, as SGLang's
parallel_state lays out --ep-size over --tp-size ranks: moe_tp_size = tp_size / ep_size
consecutive ranks share an expert group (rank r in group r // moe_tp_size), each holding its
block r % moe_tp_size of every expert's intermediate features.
"""

from __future__ import annotations

from dataclasses import dataclass


def divide(total: int, size: int, what: str) -> int:
    """`total / size`, refused when it does not divide (naming `what`)."""
    if total % size:
        raise ValueError(
            f"{what} ({total}) is not divisible by --tp-size {size}; pick a tp_size that divides it"
        )
    return total // size


@dataclass(frozen=True)
class Heads:
    """One rank's attention heads: `q` query heads and `kv` KV heads, the latter being KV head
    `kv_index` * kv, ... of the checkpoint (replicated KV heads: several ranks share an index)."""

    q: int
    kv: int
    kv_index: int


def attention_heads(num_heads: int, num_kv_heads: int, rank: int, size: int) -> Heads:
    q = divide(num_heads, size, "num_attention_heads")
    if num_kv_heads >= size:
        return Heads(q, divide(num_kv_heads, size, "num_key_value_heads"), rank)
    if size % num_kv_heads:
        raise ValueError(
            f"--tp-size {size} is neither a divisor nor a multiple of num_key_value_heads "
            f"({num_kv_heads}); KV heads are split or replicated whole"
        )
    return Heads(q, 1, rank // (size // num_kv_heads))


@dataclass(frozen=True)
class VocabRange:
    """The vocabulary rows [start, end) of one rank, in a block of `padded` rows."""

    start: int
    end: int
    padded: int

    @property
    def rows(self) -> int:
        return self.end - self.start


def vocab_range(vocab_size: int, rank: int, size: int) -> VocabRange:
    block = -(-vocab_size // size)
    start = min(rank * block, vocab_size)
    return VocabRange(start, min(start + block, vocab_size), block)


@dataclass(frozen=True)
class ExpertPlace:
    """One rank's routed experts: experts [first, first + count) of the MoE, and block `block`
    of `blocks` of each one's intermediate features (blocks 1: whole experts)."""

    first: int
    count: int
    block: int
    blocks: int


def expert_place(num_experts: int, rank: int, size: int, ep_size: int) -> ExpertPlace:
    """Rank `rank` of `size` at --ep-size `ep_size` (which divides `size` and `num_experts`:
    args/tp_checks.py refuses other values)."""
    moe_tp = size // ep_size
    group, block = divmod(rank, moe_tp)
    count = num_experts // ep_size
    return ExpertPlace(group * count, count, block, moe_tp)
