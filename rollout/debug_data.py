"""--save-debug-rollout-data / --load-debug-rollout-data: rollouts on disk, slime's format.

A file is `torch.save({"rollout_id": int, "samples": [Sample.to_dict(), ...]})`, samples flat
in group order; loading regroups them by group_index.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from rollout.sample import Sample


def debug_data_path(path_template: str, rollout_id: int) -> str:
    return path_template.format(rollout_id=rollout_id)


def save_debug_rollout_data(path_template: str, rollout_id: int, groups: list[list[Sample]]) -> str:
    """Write a rollout to `path_template` formatted with rollout_id; returns the path."""
    path = debug_data_path(path_template, rollout_id)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    torch.save(
        {"rollout_id": rollout_id, "samples": [s.to_dict() for group in groups for s in group]},
        path,
    )
    return path


def load_debug_rollout_data(path_template: str, rollout_id: int) -> list[list[Sample]]:
    """Read a rollout written by save_debug_rollout_data, as groups in their saved order."""
    path = debug_data_path(path_template, rollout_id)
    if not os.path.exists(path):
        raise FileNotFoundError(
            f"--load-debug-rollout-data: no file {path} for rollout {rollout_id}; "
            "save one first with --save-debug-rollout-data"
        )
    # Plain Python containers only, so the safe loader suffices.
    data: dict[str, Any] = torch.load(path, weights_only=True)
    groups: dict[int, list[Sample]] = {}
    for d in data["samples"]:
        sample = Sample.from_dict(d)
        if sample.group_index is None:
            raise ValueError(
                f"{path}: sample {sample.index} has no group_index, so it cannot be regrouped"
            )
        groups.setdefault(sample.group_index, []).append(sample)
    return list(groups.values())
