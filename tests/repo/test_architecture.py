"""The layout's rules, checked on the source: no import cycles (modules, and the subpackages of
spec_engine and trainer_bridge), the engine imports nothing from the RL side, no runtime package
imports the test fixtures (tiny), modules stay small, and the code cites only documents that are in
the repository."""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGES = ("spec_engine", "trainer_bridge", "rollout", "specrl", "bench", "tiny")
RUNTIME = ("spec_engine", "trainer_bridge", "rollout", "specrl")  # bench/ and tiny/ are tools
MAX_LINES = 500


def _modules() -> dict[str, pathlib.Path]:
    mods = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            mods[name] = path
    return mods


MODULES = _modules()


def _imports(name: str, path: pathlib.Path) -> set[str]:
    """Every project module `name` imports, anywhere in the file (TYPE_CHECKING and function-level
    imports included: a cycle through them is still a cycle in the design)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(
                    package.split(".")[: len(package.split(".")) - node.level + 1] + [base]
                ).strip(".")
            # `from pkg import mod` imports a module when pkg.mod is one, else a name from pkg
            targets = [
                f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names
            ]
        else:
            continue
        found.update(t for t in targets if t in MODULES and t != name)
    return found


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str]:
    """One cycle of the graph as a path, or [] when it has none."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str]:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        state[node] = 2
        stack.pop()
        return []

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return []


def test_no_module_import_cycles():
    assert _cycle(GRAPH) == []


def _parts(package: str) -> dict[str, set[str]]:
    """The import graph between `package`'s parts: its subpackages and top-level modules."""

    def part(module: str) -> str:
        return ".".join(module.split(".")[:2])

    parts: dict[str, set[str]] = {}
    for name, deps in GRAPH.items():
        if name.startswith(f"{package}."):
            parts.setdefault(part(name), set()).update(
                part(d) for d in deps if d.startswith(f"{package}.") and part(d) != part(name)
            )
    return parts


def test_no_cycles_between_engine_subpackages():
    """spec_engine's parts form layers: dtypes, mem, weights < forward_batch < layers < models <
    attention < args < runner < core < speculative < engine < server, launch_server."""
    assert _cycle(_parts("spec_engine")) == []


def test_no_cycles_between_trainer_subpackages():
    """trainer_bridge's parts form layers: spec_rewrite < micro_batches < parallel < model <
    convert < checkpoint; drafts beside them; actor (the rank that uses them all) on top."""
    assert _cycle(_parts("trainer_bridge")) == []


def test_the_cycle_finder_finds_cycles():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) == []


def test_engine_does_not_import_the_rl_side():
    offenders = {
        n: sorted(d for d in deps if not d.startswith("spec_engine"))
        for n, deps in GRAPH.items()
        if n.startswith("spec_engine")
    }
    assert {n: d for n, d in offenders.items() if d} == {}


def test_runtime_packages_do_not_import_the_fixtures():
    """tiny/ builds checkpoints and run assets for tests, examples and benchmarks; nothing a run
    executes depends on it."""
    offenders = {
        n: sorted(d for d in deps if d.split(".")[0] == "tiny")
        for n, deps in GRAPH.items()
        if n.split(".")[0] in RUNTIME
    }
    assert {n: d for n, d in offenders.items() if d} == {}


@pytest.mark.parametrize("name", sorted(MODULES))
def test_modules_stay_small(name):
    assert len(MODULES[name].read_text().splitlines()) <= MAX_LINES


def test_code_cites_only_documents_in_the_repo():
    cited = set()
    for path in list(MODULES.values()) + list((ROOT / "scripts").rglob("*.py")):
        cited.update(re.findall(r"[\w./-]+\.md\b", path.read_text()))
    missing = sorted(
        c for c in cited if not (ROOT / c).exists() and not (ROOT / "docs" / c).exists()
    )
    assert missing == []
