"""tiny: the reward of the tiny CPU task (see rollout.tiny_task).

1.0 when the response's first non-space character is the label letter (case-insensitive),
else 0.0. An empty response scores 0.0.
"""

from __future__ import annotations

from typing import Any

from rollout.rewards.label import require_label


def tiny_rm(args: Any, sample: Any) -> float:
    letter = require_label(sample, "tiny").strip().lower()
    return float(sample.response.lstrip()[:1].lower() == letter)
