"""argparse flags generated from a configuration dataclass, and the dataclass back from them.

Each field becomes `--field-name` (or the `flag` in its metadata, e.g. a `--disable-x` for a
default-on switch), with help and choices from the field metadata; booleans are switches.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from typing import Any, TypeVar

T = TypeVar("T")


def add_dataclass_args(parser: argparse.ArgumentParser, cls: type, title: str) -> None:
    hints = typing.get_type_hints(cls)
    group = parser.add_argument_group(title)
    for f in dataclasses.fields(cls):
        kwargs: dict[str, Any] = {"dest": f.name, "default": f.default, "help": f.metadata.get("help", "")}
        hint = hints[f.name]
        if typing.get_origin(hint) in (typing.Union, types.UnionType):
            hint = next(a for a in typing.get_args(hint) if a is not type(None))
        if hint is bool:
            kwargs["action"] = "store_false" if f.default else "store_true"
        else:
            kwargs["type"] = hint
            if "choices" in f.metadata:
                kwargs["choices"] = f.metadata["choices"]
        group.add_argument(f.metadata.get("flag", "--" + f.name.replace("_", "-")), **kwargs)


def dataclass_from_args(cls: type[T], namespace: argparse.Namespace) -> T:
    """Fields absent from the namespace keep their defaults."""
    names = [f.name for f in dataclasses.fields(cls)]
    return cls(**{n: getattr(namespace, n) for n in names if hasattr(namespace, n)})
