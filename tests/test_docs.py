"""The documentation stays true: the layout block matches the package, links resolve, README stays small.

Reads files only (no torch import), so it costs milliseconds.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Dict, Iterator, List, Set, Tuple

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "torchpatches"
ARCHITECTURE = ROOT / "docs" / "architecture.md"
README = ROOT / "README.md"
README_LIMIT = 10 * 1024  # README is a front door: at most 10 KB

FENCE = re.compile(r"^(```|~~~)")
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
INLINE_CODE = re.compile(r"`+[^`]*`+")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


def _prose_lines(text: str) -> Iterator[str]:
    """The lines of a Markdown file outside fenced code blocks."""
    fenced = False
    for line in text.splitlines():
        if FENCE.match(line.strip()):
            fenced = not fenced
            continue
        if not fenced:
            yield line


def _fenced_blocks(text: str) -> List[List[str]]:
    blocks: List[List[str]] = []
    current = None
    for line in text.splitlines():
        if FENCE.match(line.strip()):
            if current is None:
                current = []
            else:
                blocks.append(current)
                current = None
        elif current is not None:
            current.append(line)
    return blocks


def layout_entries(text: str) -> Set[str]:
    """Paths (relative to the repo, packages ending in '/') listed in the layout block.

    The block is the fenced block whose first line is ``torchpatches/``; each further line is
    ``<indent><name>  <what it does>``, two spaces of indentation per level.
    """
    blocks = [block for block in _fenced_blocks(text) if block and block[0].strip() == "torchpatches/"]
    assert len(blocks) == 1, "docs/architecture.md needs exactly one fenced block starting with 'torchpatches/'"
    entries = {"torchpatches/"}
    parents = ["torchpatches/"]  # parents[level] is the package at that indentation level
    for line in blocks[0][1:]:
        if not line.strip():
            continue
        indent = len(line) - len(line.lstrip(" "))
        assert indent % 2 == 0 and indent >= 2, f"layout line is not indented by a multiple of 2: {line!r}"
        level = indent // 2
        assert level <= len(parents), f"layout line is nested under nothing: {line!r}"
        name = line.split()[0]
        assert name.endswith((".py", "/")), f"layout entry is neither a module nor a package: {line!r}"
        path = parents[level - 1] + name
        entries.add(path)
        del parents[level:]
        if name.endswith("/"):
            parents.append(path)
    return entries


def package_entries(root: Path = PACKAGE) -> Set[str]:
    """The modules and packages under ``torchpatches/`` as the layout block spells them."""
    entries = set()
    for path in root.rglob("*.py"):
        if "__pycache__" in path.parts:
            continue
        relative = path.relative_to(root.parent)
        entries.add(relative.as_posix())
        for parent in relative.parents:
            if parent != Path("."):
                entries.add(parent.as_posix() + "/")
    return entries


def test_layout_block_lists_every_module_and_nothing_else() -> None:
    listed = layout_entries(ARCHITECTURE.read_text(encoding="utf-8"))
    actual = package_entries()
    assert sorted(actual - listed) == [], "modules missing from docs/architecture.md's layout block"
    assert sorted(listed - actual) == [], "docs/architecture.md's layout block lists what does not exist"


def test_layout_parser_reads_nesting_and_rejects_stray_lines() -> None:
    block = "```\ntorchpatches/\n  a.py   job\n  sub/   pkg\n    b.py  job\n  c.py   job\n```\n"
    assert layout_entries(block) == {"torchpatches/", "torchpatches/a.py", "torchpatches/sub/",
                                     "torchpatches/sub/b.py", "torchpatches/c.py"}
    with pytest.raises(AssertionError):
        layout_entries("```\ntorchpatches/\n  just words\n```\n")


def test_readme_is_a_front_door() -> None:
    assert len(README.read_bytes()) <= README_LIMIT


def test_readme_has_the_two_newcomer_commands() -> None:
    """The quick start and the test command CI runs (.ci/run: "the README's test command")."""
    blocks = ["\n".join(block).strip() for block in _fenced_blocks(README.read_text(encoding="utf-8"))]
    assert any(block.endswith("python -m torchpatches demo") and "pip install" in block for block in blocks)
    assert "tools/nox" in blocks
    assert re.search(r"^exec tools/nox\b", (ROOT / ".ci" / "run").read_text(), re.MULTILINE)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lowercase, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link keeps its text
    text = text.replace("`", "").strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(text: str) -> Set[str]:
    """Every heading anchor of a Markdown file, duplicates numbered as GitHub does (-1, -2, ...)."""
    seen: Dict[str, int] = {}
    result = set()
    for line in _prose_lines(text):
        match = HEADING.match(line)
        if not match:
            continue
        base = slug(match.group(2))
        count = seen.get(base, 0)
        result.add(base if count == 0 else f"{base}-{count}")
        seen[base] = count + 1
    return result


def relative_links(path: Path) -> List[Tuple[str, Path, str]]:
    """(link as written, file it points to, anchor or '') for every relative link outside code."""
    links = []
    for line in _prose_lines(path.read_text(encoding="utf-8")):
        for target in LINK.findall(INLINE_CODE.sub("", line)):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.IGNORECASE):  # http:, https:, mailto:
                continue
            file_part, _, anchor = target.partition("#")
            resolved = path if not file_part else (path.parent / file_part).resolve()
            links.append((target, resolved, anchor))
    return links


def test_slug_matches_github() -> None:
    assert slug("What it does to generated code (CPU, torch 2.11.0)") == "what-it-does-to-generated-code-cpu-torch-2110"
    assert slug("`qk_norm_rope`") == "qk_norm_rope"
    assert anchors("# A\n```\n# not a heading\n```\n## A\n") == {"a", "a-1"}


DOCUMENTS = [README, *sorted((ROOT / "docs").rglob("*.md"))]  # the notes too


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_resolve(document: Path) -> None:
    broken = []
    for target, resolved, anchor in relative_links(document):
        if not resolved.exists():
            broken.append(f"{target}: no such file")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved.read_text(encoding="utf-8")):
            broken.append(f"{target}: no such heading in {resolved.name}")
    assert broken == []


def test_a_broken_link_or_anchor_is_found(tmp_path: Path) -> None:
    (tmp_path / "a.md").write_text("# Title\n\n[ok](b.md#there) [gone](c.md) [bad](b.md#nowhere) `[code](x.md)`\n"
                                   "```\n[fenced](y.md)\n```\n[web](https://example.org/z.md)\n")
    (tmp_path / "b.md").write_text("## There\n")
    found = {(target, resolved.exists(), anchor in anchors(resolved.read_text()) if resolved.exists() else None)
             for target, resolved, anchor in relative_links(tmp_path / "a.md")}
    assert found == {("b.md#there", True, True), ("c.md", False, None), ("b.md#nowhere", True, False)}
