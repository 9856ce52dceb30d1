"""argparse flags generated from a configuration dataclass, and the dataclass back from them.

One field, one flag: `--{prefix}{field-name}` (the underscore spelling is accepted too, and the
`aliases` in the field's metadata, e.g. SGLang's `--model`), or the `flag` in the field's
metadata (e.g. `--disable-x` for a default-on switch). Help, `choices` and
`metavar` come from the metadata; booleans are switches, lists take one or more values, fields
without a default are required. Every package's options (engine, rollout, trainer) use this.
`HelpFormatter` lists each flag once (without its underscore spelling) with its default, and
marks required flags. A field whose default is None says what None means in its metadata's
`unset` ("no evaluation"), shown as its default, or in an "auto: ..." in its help.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import types
import typing
from collections.abc import Iterable
from typing import Any, TypeVar

T = TypeVar("T")

METAVARS = {int: "INT", float: "FLOAT", str: "STR"}


def add_dataclass_args(
    parser: argparse.ArgumentParser,
    cls: type,
    title: str,
    prefix: str = "",
    exclude: Iterable[str] = (),
    required: Iterable[str] = (),
) -> None:
    """One flag per field of `cls` in a group titled `title`; `exclude` names fields left out,
    `required` fields a command line must give although the dataclass has a default for them."""
    hints = typing.get_type_hints(cls)
    skip, needed = set(exclude), set(required)
    group = parser.add_argument_group(title)
    for f in dataclasses.fields(cls):
        if f.name in skip or not f.metadata.get("cli", True):
            continue
        if "flag" in f.metadata:
            names = [f.metadata["flag"]]
        else:
            names = [f"--{prefix}{f.name}".replace("_", "-")]
            alias = f"--{prefix.replace('-', '_')}{f.name}"
            if alias != names[0]:
                names.append(alias)
            names.extend(f"--{prefix}{a}" for a in f.metadata.get("aliases", ()))
        kwargs: dict[str, Any] = {"dest": dest(prefix, f.name), "help": f.metadata.get("help", "")}
        if f.name in needed or (
            f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        ):
            kwargs["required"] = True
        elif f.default is not dataclasses.MISSING:
            kwargs["default"] = f.default
        else:
            kwargs["default"] = f.default_factory()
        if kwargs.get("default", False) is None and "unset" in f.metadata:
            kwargs["help"] += f" (default: {f.metadata['unset']})"
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
            if "choices" not in kwargs:  # argparse shows choices as {a,b} when no metavar is set
                kwargs.setdefault("metavar", METAVARS.get(inner))
        group.add_argument(*names, **kwargs)


def dataclass_from_args(
    cls: type[T], namespace: argparse.Namespace, prefix: str = "", **overrides: Any
) -> T:
    """`cls` from the parsed flags: fields absent from the namespace keep their defaults, and
    `overrides` (launcher-owned values) win."""
    values = {}
    for f in dataclasses.fields(cls):
        name = dest(prefix, f.name)
        if hasattr(namespace, name):
            values[f.name] = getattr(namespace, name)
    values.update(overrides)
    return cls(**values)


def dest(prefix: str, name: str) -> str:
    return f"{prefix.replace('-', '_')}{name}"


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Each flag once, under its dashed name, with "(default: X)" or "(required)" after its help.

    Switches show no default (a switch is off unless given); a None default shows the field's
    `unset` text, added to its help by add_dataclass_args, or its help's "auto: ...".
    """

    def _format_action_invocation(self, action: argparse.Action) -> str:
        shown = [s for s in action.option_strings if not _is_alias(s, action.option_strings)]
        if len(shown) == len(action.option_strings):
            return super()._format_action_invocation(action)
        action = copy.copy(action)
        action.option_strings = shown
        return super()._format_action_invocation(action)

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.required:
            return f"{text} (required)"
        if action.nargs == 0 or action.default in (None, argparse.SUPPRESS):
            return text
        return f"{text} (default: %(default)s)"


def _is_alias(option: str, options: list[str]) -> bool:
    """`--x_y` is the underscore spelling of `--x-y` when the same flag also has that name."""
    return "_" in option and option.replace("_", "-") in options


def _flag_type(hint: Any) -> tuple[type, type]:
    """(kind, element type) of a field's type hint: Optional[X] is X, list[X] is (list, X)."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return _flag_type(next(a for a in typing.get_args(hint) if a is not type(None)))
    if origin is list:
        return list, typing.get_args(hint)[0]
    return hint, hint
