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
"""

from __future__ import annotations

import collections
import json
import os
import random
import string
from typing import Any, Optional

from rollout.rewards.tiny import VARY

PROMPT_FORMAT = "copy: {letter}"


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
) -> list[str]:
    """Write `n` prompts {"input": "copy: <letter>", "label": "<letter>"} as JSONL (labels
    cycle over the letters in a seeded random order); returns the letters used.
    Train with --input-key input --label-key label --rm-type tiny.

    `drift_at`: the drift variant. From that record on the label is "<letter>/vary": the
    response must also stop repeating itself (rollout.rewards.tiny), which the warm-up taught the
    policy to do, so the rewarded continuation changes mid-run and a draft that learned the
    first half's outputs goes stale. Read the file in order (no --rollout-shuffle) and the shift
    comes at rollout drift_at / --rollout-batch-size."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    if drift_at is not None and not 0 <= drift_at <= n:
        raise ValueError(f"drift_at must be in [0, n={n}], got {drift_at}")
    letters = tiny_task_letters(tokenizer, num_letters)
    labels = [letters[i % len(letters)] for i in range(n)]
    random.Random(seed).shuffle(labels)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        for i, letter in enumerate(labels):
            rewarded = letter + VARY if drift_at is not None and i >= drift_at else letter
            record = {"input": PROMPT_FORMAT.format(letter=letter), "label": rewarded}
            f.write(json.dumps(record) + "\n")
    return letters
