"""tiny: the reward of the tiny CPU task (see rollout.tiny_task).

1.0 when the response's first non-space character is the label letter (case-insensitive),
else 0.0. An empty response scores 0.0. A label "<letter>/vary" (the drift task's second half)
also asks the response not to be one piece of text repeated (" bird bird bird bird" scores 0.0,
" bird cat ..." 1.0): the warm-up taught the policy to repeat its first token, so the rewarded
continuation changes mid-run.
"""

from __future__ import annotations

from typing import Any

from rollout.rewards.label import require_label

VARY = "/vary"


def repeats(text: str) -> bool:
    """Whether `text` is one shorter piece repeated (" ab ab" yes, " ab ac" no)."""
    return any(
        len(text) % k == 0 and text == text[:k] * (len(text) // k) for k in range(1, len(text))
    )


def tiny_rm(args: Any, sample: Any) -> float:
    label = require_label(sample, "tiny").strip().lower()
    letter, vary = label.removesuffix(VARY), label.endswith(VARY)
    if sample.response.lstrip()[:1].lower() != letter:
        return 0.0
    return float(not (vary and repeats(sample.response)))
