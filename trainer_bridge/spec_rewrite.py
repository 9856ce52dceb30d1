"""Copies of megatron-core layer specs (ModuleSpec, TransformerBlockSubmodules, the MTP block's)
with some of their fields replaced: how the trainer adapts megatron's local spec (its norms under
sequence parallelism, packed attention, the MLA down projection, checkpoint names)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any


def swap_in_spec(node: Any, rule: Callable[[str, Any], Any], field: str = "") -> Any:
    """`node` with `rule(field name, value)` applied to every field of the nested dataclasses
    and lists, copied only where something changed (a value the rule replaces is not descended
    into)."""
    if (replaced := rule(field, node)) is not node:
        return replaced
    if isinstance(node, list):
        swapped = [swap_in_spec(n, rule, field) for n in node]
        return swapped if any(a is not b for a, b in zip(swapped, node)) else node
    if not dataclasses.is_dataclass(node) or isinstance(node, type):
        return node
    changes = {}
    for f in dataclasses.fields(node):
        value = getattr(node, f.name)
        if (swapped := swap_in_spec(value, rule, f.name)) is not value:
            changes[f.name] = swapped
    return dataclasses.replace(node, **changes) if changes else node
