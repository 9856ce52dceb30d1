"""What each rank holds: attention heads, vocabulary rows, features of a split linear.

SGLang's and nano-vllm's rules: query heads and MLP features split evenly; KV heads split while
there are at least as many as ranks, and past that each KV head is replicated on
tp_size / num_kv_heads consecutive ranks (rank r holds KV head r // replicas); the vocabulary is
split in equal blocks of ceil(vocab / tp_size) rows, the last one short (its padding rows are
never looked up and their logits are cut after the gather).
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
