"""Documents cite what the repository holds: no module or Markdown file points at a file that
is not here.

Three checks over the working tree (generated and ignored folders left out):

- every ``*.md`` name a Python file (docstring, comment or string) or a Markdown file mentions
  is a file of the repository, found from the root or from the mentioning file's folder;
- every repository path a module docstring, a comment or a Markdown file names
  (``gpu_workers/engine.py``, ``docs/plots/``) exists; paths under git-ignored output folders
  (``bench/out/``) and patterns (``schemas/*.avsc``, ``<name>``) are not files and are skipped;
- every relative Markdown link resolves, and a link's ``#anchor`` names a heading of its target
  (GitHub's heading slugs).

The design document itself must exist: module docstrings cite it by section.
"""

from __future__ import annotations

import ast
import functools
import io
import re
import tokenize
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SKIP_DIRS = frozenset(
    {
        ".git",
        ".venv",
        "__pycache__",
        ".pytest_cache",
        ".ruff_cache",
        ".mypy_cache",
        ".hypothesis",
        ".epd",
        "build",
        "dist",
        "node_modules",
    }
)
PLACEHOLDER = re.compile(r"[*<>{}$?\[\]]")
MD_NAME = re.compile(r"(?<![\w./-])([\w./-]*\w\.md)\b")
LINK = re.compile(r"(?<!!)\[(?:[^\]\n]|\][^(\n])*\]\(([^)\s]+)\)|!\[[^\]\n]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^\s*(```|~~~)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


def _ignored_dirs(root: Path) -> frozenset[str]:
    """Folders ``.gitignore`` names by a path (``bench/out/``): generated output, not sources."""
    gitignore = root / ".gitignore"
    out = set()
    if gitignore.exists():
        for line in gitignore.read_text().splitlines():
            line = line.strip().strip("/")
            if line and "/" in line and not PLACEHOLDER.search(line):
                out.add(line)
    return frozenset(out)


def source_files(root: Path, suffix: str) -> Iterator[Path]:
    """Files ending in ``suffix`` under ``root``, without generated or ignored folders."""
    ignored = _ignored_dirs(root)
    stack = [root]
    while stack:
        folder = stack.pop()
        for entry in sorted(folder.iterdir()):
            rel = entry.relative_to(root).as_posix()
            if entry.is_dir():
                if entry.name not in SKIP_DIRS and not entry.name.endswith(".egg-info"):
                    if rel not in ignored:
                        stack.append(entry)
            elif entry.name.endswith(suffix):
                yield entry


def top_folders(root: Path) -> list[str]:
    """The repository's top-level folders: what a cited path starts with."""
    return sorted(p.name for p in root.iterdir() if p.is_dir() and p.name not in SKIP_DIRS)


def path_pattern(root: Path) -> re.Pattern[str]:
    """A repository path in prose: a top-level folder, a slash, more path characters."""
    tops = "|".join(re.escape(t) for t in top_folders(root))
    return re.compile(rf"(?<![\w./~-])((?:{tops})/[\w./-]*)")


def prose_of_python(path: Path) -> str:
    """A module's docstrings (module, classes, functions) and comments, one per line."""
    text = path.read_text()
    parts: list[str] = []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            doc = ast.get_docstring(node, clean=False)
            if doc:
                parts.append(doc)
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type == tokenize.COMMENT:
            parts.append(tok.string)
    return "\n".join(parts)


def outside_fences(text: str) -> Iterator[str]:
    """The lines of a Markdown text that are not inside a fenced code block."""
    fenced = False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            yield line


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces -> hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text stays
    text = text.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


@functools.cache
def anchors(path: Path) -> frozenset[str]:
    """Every heading anchor of a Markdown file (repeats get GitHub's ``-1``, ``-2``)."""
    seen: dict[str, int] = {}
    out: set[str] = set()
    for line in outside_fences(path.read_text()):
        m = HEADING.match(line)
        if not m:
            continue
        base = slug(m.group(2))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return frozenset(out)


def missing_paths(root: Path, text: str, pattern: re.Pattern[str]) -> list[str]:
    """Repository paths named in ``text`` that do not exist (patterns and ignored output
    skipped)."""
    ignored = _ignored_dirs(root)
    out = []
    for m in pattern.finditer(text):
        cited = m.group(1).rstrip(".,:;")
        if PLACEHOLDER.search(cited) or any(
            cited == d or cited.startswith(d + "/") for d in ignored
        ):
            continue
        if not (root / cited).exists():
            out.append(cited)
    return out


def missing_md_names(root: Path, path: Path, text: str) -> list[str]:
    """``*.md`` names in ``text`` that are neither at the root nor beside ``path``."""
    out = []
    for m in MD_NAME.finditer(text):
        name = m.group(1)
        if PLACEHOLDER.search(name):
            continue
        if not ((root / name).is_file() or (path.parent / name).is_file()):
            out.append(name)
    return out


def broken_links(path: Path) -> list[str]:
    """Relative links of a Markdown file whose target or ``#anchor`` is not there."""
    out = []
    for line in outside_fences(path.read_text()):
        for m in LINK.finditer(re.sub(r"`[^`]*`", "", line)):
            target = m.group(1) or m.group(2)
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:, data:
                continue
            file_part, _, anchor = target.partition("#")
            dest = (path.parent / file_part).resolve() if file_part else path
            if not dest.exists():
                out.append(target)
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                out.append(target)
    return out


def _rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def test_the_design_document_is_in_the_repository() -> None:
    design = ROOT / "docs" / "design.md"
    assert design.is_file()
    # The sections module docstrings and the README cite by anchor.
    for section in (
        "topics-and-events",
        "stages",
        "stores",
        "validation-rules",
        "delivery-guarantees",
        "budgets",
        "departures-from-the-brief",
    ):
        assert section in anchors(design), section


def test_python_files_cite_only_markdown_files_that_exist() -> None:
    this = Path(__file__).resolve()
    bad = {
        _rel(p): names
        for p in source_files(ROOT, ".py")
        if p.resolve() != this and (names := missing_md_names(ROOT, p, p.read_text()))
    }
    assert bad == {}


def test_docstrings_and_comments_name_only_paths_that_exist() -> None:
    pattern = path_pattern(ROOT)
    this = Path(__file__).resolve()
    bad = {}
    for p in source_files(ROOT, ".py"):
        # Tokenizing every module is slow: only one whose text names a missing path at all
        # (perhaps in a string, which is data) is read for its docstrings and comments.
        if p.resolve() == this or not missing_paths(ROOT, p.read_text(), pattern):
            continue
        if paths := missing_paths(ROOT, prose_of_python(p), pattern):
            bad[_rel(p)] = paths
    assert bad == {}


def test_markdown_files_name_only_paths_that_exist() -> None:
    pattern = path_pattern(ROOT)
    bad = {
        _rel(p): paths
        for p in source_files(ROOT, ".md")
        if (
            paths := missing_paths(ROOT, p.read_text(), pattern)
            + missing_md_names(ROOT, p, p.read_text())
        )
    }
    assert bad == {}


def test_markdown_links_resolve_with_their_anchors() -> None:
    bad = {_rel(p): links for p in source_files(ROOT, ".md") if (links := broken_links(p))}
    assert bad == {}


# The checkers themselves, on files made here: each finds what it is for.


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    (tmp_path / "pkg").mkdir()
    (tmp_path / "docs").mkdir()
    (tmp_path / "out").mkdir()
    (tmp_path / ".gitignore").write_text("pkg/gen/\n")
    (tmp_path / "README.md").write_text("# Title\n\n## The `epd` command\n\n## Steps\n## Steps\n")
    (tmp_path / "docs" / "guide.md").write_text(
        "# Guide\n\n```\n# not a heading\n[x](nowhere.md)\n```\n"
        "[ok](../README.md#the-epd-command) [again](../README.md#steps-1) "
        "[self](#guide) [web](https://example.com/x.md) `[code](gone.md)`\n"
        "[file](../pkg/mod.py) [bad anchor](../README.md#nope) [gone](missing.md)\n"
    )
    (tmp_path / "pkg" / "mod.py").write_text(
        '"""See docs/guide.md and pkg/gone.py; pkg/gen/x.py is output; pkg/*.py a pattern."""\n'
        "# docs/missing.md is cited in a comment\n"
        "X = 'runtime/status_store.py:90 in a string is data, not a citation'\n"
        "HELP = 'the budgets of ELSEWHERE.md'\n"
    )
    return tmp_path


def test_the_link_checker_finds_broken_links_and_anchors(repo: Path) -> None:
    assert broken_links(repo / "docs" / "guide.md") == ["../README.md#nope", "missing.md"]
    assert anchors(repo / "README.md") == {"title", "the-epd-command", "steps", "steps-1"}


def test_the_path_checker_reads_docstrings_and_comments_only(repo: Path) -> None:
    prose = prose_of_python(repo / "pkg" / "mod.py")
    assert missing_paths(repo, prose, path_pattern(repo)) == ["pkg/gone.py", "docs/missing.md"]


def test_the_markdown_name_checker_reads_the_whole_module(repo: Path) -> None:
    mod = repo / "pkg" / "mod.py"
    assert missing_md_names(repo, mod, mod.read_text()) == ["docs/missing.md", "ELSEWHERE.md"]
