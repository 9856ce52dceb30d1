"""exact_match: 1.0 when the response equals the label, ignoring surrounding whitespace."""

from __future__ import annotations

from typing import Any

from rollout.rewards.label import require_label


def exact_match_rm(args: Any, sample: Any) -> float:
    return float(sample.response.strip() == require_label(sample, "exact_match").strip())
