"""The tiny CPU task: a prompt names a letter; a response that starts with that letter scores 1.

    {"input": "copy: b", "label": "b"}   ->  " bird ..." scores 1.0, " cat ..." scores 0.0

Reward (`--rm-type tiny`, rollout.rewards.tiny): 1.0 when the response's first non-space
character is the label letter, case-insensitive; else 0.0. Only the first token matters, so
`--rollout-max-response-len` can be tiny (1-4).

Why this task: it must be learnable in a few RL steps by a tiny *random* model. Copying an exact
token would succeed about 1/vocab of the time (0.2% for the 512-token test tokenizer), too rare
for group-relative advantages to see. Any vocabulary token that starts with the letter counts
here, and the letters are the ones most vocabulary entries start with, so a random policy already
succeeds a few percent of the time (about 4-6% per letter on the test tokenizer), groups of 8
often hold a success, and the policy only has to move probability mass towards a token class
that depends on the last prompt token. Measured on the 512-token tiny Llama of
scripts/make_tiny_model.py with a bare policy gradient on the first token (4 prompts x 8
samples, group-normalized rewards, Adam lr 3e-3): the mean reward went from ~5% to ~60% in 35
steps. Pair it with --dynamic-sampling-filter-path rollout.filters.check_reward_nonzero_std
early on, when most groups score all zeros.

The long-tailed variant (`write_tiny_task(..., long_tail=True)`, `TASK=longtail` in
scripts/run-tiny-cpu.sh): each prompt also carries a response length, `metadata.max_new_tokens`,
drawn from a Pareto distribution (`long_tail_lengths`: scale 4, shape 1.2, capped at 64: half
the prompts want at most 7 tokens, one in twelve 32 or more), and `long_tail_generate`
(--custom-generate-function-path) generates each response up to its prompt's length. The reward
is the same, so the runs learn alike; a rollout's time is set by its longest groups, the long
tail that --partial-rollout, scripts/train_async.py and adaptive speculation attack
(docs/benchmarks/long_tail_cpu.md).
"""

from __future__ import annotations

import collections
import json
import os
import random
import string
from typing import Any, Optional

from rollout.generate import generate
from rollout.rewards.tiny import VARY
from rollout.sample import Sample

PROMPT_FORMAT = "copy: {letter}"
# The long-tailed task's response lengths: Pareto(scale, shape), capped.
LONG_TAIL_SCALE, LONG_TAIL_SHAPE, LONG_TAIL_MAX = 4, 1.2, 64


def letter_shares(tokenizer: Any) -> dict[str, float]:
    """For each letter a-z, the share of vocabulary tokens whose text starts with it."""
    size = len(tokenizer)
    counts: collections.Counter[str] = collections.Counter()
    for token_id in range(size):
        first = tokenizer.decode([token_id]).lstrip()[:1].lower()
        if first in string.ascii_lowercase:
            counts[first] += 1
    return {letter: counts[letter] / size for letter in string.ascii_lowercase}


def tiny_task_letters(tokenizer: Any, num_letters: int = 4) -> list[str]:
    """The `num_letters` letters that most vocabulary tokens start with (ties alphabetical)."""
    if not 1 <= num_letters <= 26:
        raise ValueError(f"num_letters must be in [1, 26], got {num_letters}")
    shares = letter_shares(tokenizer)
    ranked = sorted(shares, key=lambda letter: (-shares[letter], letter))
    if shares[ranked[num_letters - 1]] == 0:
        raise ValueError(
            f"the tokenizer's vocabulary has fewer than {num_letters} letters that start a token; "
            "lower num_letters"
        )
    return sorted(ranked[:num_letters])


def write_tiny_task(
    path: str,
    tokenizer: Any,
    n: int = 256,
    num_letters: int = 4,
    seed: int = 0,
    drift_at: Optional[int] = None,
    long_tail: bool = False,
) -> list[str]:
    """Write `n` prompts {"input": "copy: <letter>", "label": "<letter>"} as JSONL (labels
    cycle over the letters in a seeded random order); returns the letters used.
    Train with --input-key input --label-key label --rm-type tiny.

    `drift_at`: the drift variant. From that record on the label is "<letter>/vary": the
    response must also stop repeating itself (rollout.rewards.tiny), which the warm-up taught the
    policy to do, so the rewarded continuation changes mid-run and a draft that learned the
    first half's outputs goes stale. Read the file in order (no --rollout-shuffle) and the shift
    comes at rollout drift_at / --rollout-batch-size.

    `long_tail`: each record also has {"metadata": {"max_new_tokens": L}}, L from
    `long_tail_lengths`; generate with --custom-generate-function-path
    rollout.tiny_task.long_tail_generate and --rollout-max-response-len >= LONG_TAIL_MAX."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    if drift_at is not None and not 0 <= drift_at <= n:
        raise ValueError(f"drift_at must be in [0, n={n}], got {drift_at}")
    letters = tiny_task_letters(tokenizer, num_letters)
    labels = [letters[i % len(letters)] for i in range(n)]
    random.Random(seed).shuffle(labels)
    lengths = long_tail_lengths(n, seed)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        for i, letter in enumerate(labels):
            rewarded = letter + VARY if drift_at is not None and i >= drift_at else letter
            record = {"input": PROMPT_FORMAT.format(letter=letter), "label": rewarded}
            if long_tail:
                record["metadata"] = {"max_new_tokens": lengths[i]}
            f.write(json.dumps(record) + "\n")
    return letters


def long_tail_lengths(n: int, seed: int = 0) -> list[int]:
    """`n` response lengths, most short and a few long: Pareto(LONG_TAIL_SCALE,
    LONG_TAIL_SHAPE) rounded down, capped at LONG_TAIL_MAX."""
    rng = random.Random(f"long-tail-{seed}")
    draws = (LONG_TAIL_SCALE * rng.paretovariate(LONG_TAIL_SHAPE) for _ in range(n))
    return [min(LONG_TAIL_MAX, int(x)) for x in draws]


async def long_tail_generate(
    args: Any, sample: Sample, sampling_params: dict[str, Any], engine: Any
) -> Sample:
    """The long-tailed task's --custom-generate-function-path: the default generate (partial
    responses continued as it does), each response limited to its prompt's
    metadata.max_new_tokens (and to --rollout-max-response-len)."""
    limit = sample.metadata.get("max_new_tokens")
    if limit is not None:
        cap = sampling_params.get("max_new_tokens")
        limit = limit if cap is None else min(limit, cap)
        sampling_params = {**sampling_params, "max_new_tokens": limit}
    return await generate(args, sample, sampling_params, engine)
