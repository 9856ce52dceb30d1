"""docs/architecture.md names what is there: every path in its inline code exists, and every
module, class, function and method it cites by name is in the source (found without importing
it). A name is resolved through the longest prefix that names a module, in full or by its tail
(`spec_engine.core.scheduler`, `core.scheduler`, `scheduler`), then a top-level name of that
module, then a member of that class (its methods, class attributes, `self.x` assignments,
inherited by base-class name); a class or a `_private` name cited alone must exist somewhere."""

from __future__ import annotations

import ast
import builtins
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "architecture.md"
PACKAGES = ("spec_engine", "trainer_bridge", "rollout", "specrl", "bench", "tiny", "scripts")
# Where a relative path of the page may start: the root, the packages and their subpackages.
PATH_BASES = [ROOT, ROOT / "docs"] + [
    d for p in PACKAGES for d in [ROOT / p, *(ROOT / p).iterdir()] if d.is_dir()
]
METRIC_PREFIXES = ("rollout", "train", "perf", "eval")  # `rollout/spec_accept_alarm` is a key
DATA_SUFFIXES = (".safetensors", ".json", ".jsonl", ".txt", ".pt", ".md", ".svg")  # a run's files
PY_FILES = {p.name for d in (*PACKAGES, "tests", "examples") for p in (ROOT / d).rglob("*.py")}


def _index() -> tuple[dict[str, set[str]], dict[str, list[tuple[set[str], list[str]]]], set[str]]:
    """Each module's top-level names, each class's members and bases, and every identifier."""
    top: dict[str, set[str]] = {}
    classes: dict[str, list[tuple[set[str], list[str]]]] = {}
    names: set[str] = set(dir(builtins))
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            tree = ast.parse(path.read_text())
            top[module] = {n for node in tree.body for n in _defined(node)}
            for node in ast.walk(tree):
                if isinstance(node, ast.ClassDef):
                    members = {n for item in node.body for n in _defined(item)}
                    members |= {
                        t.attr
                        for t in ast.walk(node)
                        if isinstance(t, ast.Attribute)
                        and isinstance(t.value, ast.Name)
                        and t.value.id == "self"
                    }
                    bases = [ast.unparse(b).split(".")[-1].split("[")[0] for b in node.bases]
                    classes.setdefault(node.name, []).append((members, bases))
                for field in ("name", "id", "attr", "arg"):
                    value = getattr(node, field, None)
                    if isinstance(value, str):
                        names.add(value)
    return top, classes, names


def _defined(node: ast.AST) -> set[str]:
    """The names a statement defines: a def or class, assignment targets, imports."""
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return {node.name}
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        return {(a.asname or a.name).split(".")[0] for a in node.names}
    targets = node.targets if isinstance(node, ast.Assign) else []
    if isinstance(node, (ast.AnnAssign, ast.AugAssign)):
        targets = [node.target]
    return {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}


TOP, CLASSES, NAMES = _index()


def _has_member(cls: str, member: str, seen: frozenset[str] = frozenset()) -> bool:
    return any(
        member in members or any(_has_member(b, member, seen | {cls}) for b in bases - seen)
        for members, bases in ((m, set(b)) for m, b in CLASSES.get(cls, []))
    )


def _in_module(module: str, rest: list[str]) -> str | None:
    """None when `rest` names something in `module`, else what is missing."""
    if not rest:
        return None
    if f"{module}.{rest[0]}" in TOP:
        return _in_module(f"{module}.{rest[0]}", rest[1:])
    if rest[0] not in TOP[module]:
        return f"{module} has no {rest[0]}"
    if len(rest) > 1 and rest[0] in CLASSES and not _has_member(rest[0], rest[1]):
        return f"{rest[0]} has no {rest[1]}"
    return None


def check_name(name: str) -> str | None:
    parts = name.split(".")
    for k in range(len(parts), 0, -1):
        prefix = ".".join(parts[:k])
        modules = [m for m in TOP if m == prefix or m.endswith("." + prefix)]
        if modules:
            errors = [_in_module(m, parts[k:]) for m in modules]
            if None in errors:
                return None
            # `worker.decode_kv_demand`, `args.options`: a variable's attribute, not a module's
            attributes = parts[1:]
            if (
                k == 1
                and parts[0] not in PACKAGES
                and all(p in NAMES and p.islower() for p in attributes)
            ):
                return None
            return errors[0]
    if parts[0] in CLASSES:
        missing = len(parts) > 1 and not _has_member(parts[0], parts[1])
        return f"{parts[0]} has no {parts[1]}" if missing else None
    if parts[0][0].isupper() or parts[0].startswith("_"):
        return None if parts[0] in NAMES else f"no {parts[0]} in the code"
    return None


def check_path(path: str) -> str | None:
    head, _, rest = path.partition("/")
    if head in METRIC_PREFIXES and rest and "." not in rest:
        return None
    if any((base / path).exists() for base in PATH_BASES):
        return None
    return "no such path"


def problems(text: str) -> list[str]:
    found = []
    text = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)  # code blocks: diagrams, a sketch
    for span in re.findall(r"`([^`\n]+)`", text):
        if span.startswith(("-", "python ")) or " --" in span:
            continue  # a command or a flag
        for token in re.findall(r"[\w./-]+", span.split("(")[0].split("=")[0]):
            token = token.strip(".")
            if not token or token[0] in "-/" or token + "*" in span:
                continue
            if "/" in token:
                error = check_path(token)
            elif token.endswith(".py"):
                error = None if token in PY_FILES else "no such file"
            elif token.endswith(DATA_SUFFIXES):
                error = None
            elif re.fullmatch(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*", token) and not token.isupper():
                error = check_name(token)
            else:
                error = None
            if error:
                found.append(f"`{span}`: {error}")
    return found


def test_architecture_doc_names_what_is_there():
    assert problems(PAGE.read_text()) == []


def test_the_check_finds_what_is_not_there():
    stale = (
        "`core.adaptive.SpecCostModel` `Scheduler._decode_groups` `trainer_bridge/actor.py` "
        "`SpecPolicy.no_such_method` `_no_such_helper` `NoSuchClass` "
        "`trainer_bridge.model_provider.read_model_config` `specrl/tiny_models.py`"
    )
    assert len(problems(stale)) == 8
    fine = "`core.scheduler.Scheduler.step` `SpecPolicy.plan` `trainer_bridge/actor/` `DTYPES`"
    assert problems(fine) == []
