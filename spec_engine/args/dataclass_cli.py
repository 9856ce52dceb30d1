"""argparse flags generated from a configuration dataclass, and the dataclass back from them.

One field, one flag: `--{prefix}{field-name}` (the underscore spelling is accepted too), or the
`flag` in the field's metadata (e.g. `--disable-x` for a default-on switch). Help, `choices` and
`metavar` come from the metadata; booleans are switches, lists take one or more values, fields
without a default are required. Every package's options (engine, rollout, trainer) use this.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from typing import Any, Iterable, TypeVar

T = TypeVar("T")


def add_dataclass_args(parser: argparse.ArgumentParser, cls: type, title: str, prefix: str = "",
                       exclude: Iterable[str] = ()) -> None:
    hints = typing.get_type_hints(cls)
    skip = set(exclude)
    group = parser.add_argument_group(title)
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        if "flag" in f.metadata:
            names = [f.metadata["flag"]]
        else:
            names = [f"--{prefix}{f.name}".replace("_", "-")]
            alias = f"--{prefix.replace('-', '_')}{f.name}"
            if alias != names[0]:
                names.append(alias)
        kwargs: dict[str, Any] = {"dest": dest(prefix, f.name), "help": f.metadata.get("help", "")}
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            kwargs["required"] = True
        else:
            kwargs["default"] = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        kind, inner = _flag_type(hints[f.name])
        if kind is bool:
            kwargs["action"] = "store_false" if kwargs.get("default") else "store_true"
        else:
            kwargs["type"] = inner
            if kind is list:
                kwargs["nargs"] = "+"
            for key in ("choices", "metavar"):
                if key in f.metadata:
                    kwargs[key] = f.metadata[key]
        group.add_argument(*names, **kwargs)


def dataclass_from_args(cls: type[T], namespace: argparse.Namespace, prefix: str = "", **overrides: Any) -> T:
    """Fields absent from the namespace keep their defaults; `overrides` (launcher-owned values) win."""
    values = {}
    for f in dataclasses.fields(cls):
        name = dest(prefix, f.name)
        if hasattr(namespace, name):
            values[f.name] = getattr(namespace, name)
    values.update(overrides)
    return cls(**values)


def dest(prefix: str, name: str) -> str:
    return f"{prefix.replace('-', '_')}{name}"


def _flag_type(hint: Any) -> tuple[type, type]:
    """(kind, element type) of a field's type hint: Optional[X] is X, list[X] is (list, X)."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return _flag_type(next(a for a in typing.get_args(hint) if a is not type(None)))
    if origin is list:
        return list, typing.get_args(hint)[0]
    return hint, hint
