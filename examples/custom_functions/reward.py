"""A custom reward function: partial credit for the answer after the tool's "Answer:".

    --custom-rm-path examples.custom_functions.reward.answer_reward

Called once per finished sample with the rollout options and the filled Sample; returns a
float. `async def` works too (e.g. to call a reward model over HTTP).
"""

from __future__ import annotations

from typing import Any

from rollout import Sample

CORRECT, WELL_FORMED, WRONG = 1.0, 0.2, 0.0


def answer_reward(args: Any, sample: Sample) -> float:
    """1.0 when the answer starts with the label letter, 0.2 when it starts with another
    letter (the right form), else 0.0. The label comes from --label-key."""
    # A single-turn response (it stopped before the tool) is all answer.
    answer = sample.response.rsplit("Answer:", 1)[-1].strip()
    # Metadata is saved with the sample (--save-debug-rollout-data): handy to see why it scored.
    sample.metadata["answer"] = answer
    if answer[:1].lower() == str(sample.label).lower():
        return CORRECT
    return WELL_FORMED if answer[:1].isalpha() else WRONG
