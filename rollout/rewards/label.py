"""The label a built-in reward compares with."""

from __future__ import annotations

from typing import Any


def require_label(sample: Any, rm_name: str) -> str:
    """The sample's label as text; refused, naming the flag to set, when the data has none."""
    if sample.label is None:
        raise ValueError(
            f"--rm-type {rm_name} compares with the label, but sample {sample.index} has none; "
            "set --label-key to the label's key in the prompt data"
        )
    return str(sample.label)
