"""The documentation's relative links resolve: every link and image in README.md and docs/**/*.md
names a file or folder of the repository, and an anchor names a heading of that page (GitHub's
slugs). Every file under docs/benchmarks/ is linked from one of those pages."""

from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.MULTILINE | re.DOTALL)


def _prose(text: str) -> str:
    """The text outside fenced code blocks and inline code spans."""
    return re.sub(r"`[^`\n]*`", "", FENCE.sub("", text))


def _anchors(page: pathlib.Path) -> set[str]:
    """GitHub's heading slugs: lower case, punctuation (backticks too) dropped, spaces to hyphens,
    a repeated slug numbered."""
    seen: dict[str, int] = {}
    for line in FENCE.sub("", page.read_text()).splitlines():
        heading = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if heading is None:
            continue
        text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.group(1))
        slug = re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")
        seen[slug] = seen.get(slug, -1) + 1
        if seen[slug]:
            seen[f"{slug}-{seen[slug]}"] = 0
    return set(seen)


def _links() -> list[tuple[pathlib.Path, str]]:
    return [(page, m.group(1)) for page in PAGES for m in LINK.finditer(_prose(page.read_text()))]


def test_relative_links_and_anchors_resolve():
    broken = []
    for page, target in _links():
        if re.match(r"[a-z]+:", target):
            continue  # http(s), mailto
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
        elif anchor and dest.suffix == ".md":
            if anchor not in _anchors(dest):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert broken == []


def test_every_benchmark_file_is_linked():
    linked = set()
    for page, target in _links():
        path = target.partition("#")[0]
        if path and not re.match(r"[a-z]+:", target):
            linked.add((page.parent / path).resolve())
    bench = ROOT / "docs" / "benchmarks"
    files = [p for p in bench.rglob("*") if p.is_file() and p.name != "README.md"]
    assert files
    assert sorted(str(p.relative_to(bench)) for p in files if p.resolve() not in linked) == []
