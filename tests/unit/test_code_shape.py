"""The code keeps the shape the architecture asks of it (docs/design.md, "Floors and one-fact
tables"): no function in product code over 60 lines, no class with behaviour over 300, and the
README's floor table names every top-level package.

Functions and classes are measured from their ``def``/``class`` line to their last line
(docstring and decorators' bodies included), as a reader meets them. Settings and data models
are tables of fields rather than behaviour, and the reference path is kept whole on purpose
(one function a reader can check against the model's own ``generate``): they are named here.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from tests.unit.test_import_graph import PACKAGES

ROOT = Path(__file__).resolve().parents[2]
PRODUCT = ("frontend", "producers", "consumers", "gpu_workers", "media", "runtime")
"""The floors whose code runs in the services (the command line, bench and contract aside)."""
MAX_FUNCTION_LINES = 60
MAX_CLASS_LINES = 300
EXEMPT = {
    "gpu_workers/oracle.py::generate_monolithic": "the reference path, kept whole",
    "runtime/settings.py::Settings": "a settings model: one field declaration per setting",
}


def _oversized() -> list[str]:
    found = []
    for folder in PRODUCT:
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            for node in ast.walk(ast.parse(path.read_text(), rel)):
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                    limit = MAX_FUNCTION_LINES
                elif isinstance(node, ast.ClassDef):
                    limit = MAX_CLASS_LINES
                else:
                    continue
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                if lines > limit and f"{rel}::{node.name}" not in EXEMPT:
                    found.append(f"{rel}:{node.lineno} {node.name}: {lines} lines (> {limit})")
    return found


def test_no_function_over_60_lines_and_no_class_over_300_in_product_code() -> None:
    assert _oversized() == []


def test_the_exemptions_still_exist() -> None:
    for name in EXEMPT:
        rel, _, symbol = name.partition("::")
        tree = ast.parse((ROOT / rel).read_text())
        assert any(getattr(n, "name", None) == symbol for n in ast.walk(tree)), name


def test_the_readme_floor_table_names_every_package() -> None:
    readme = (ROOT / "README.md").read_text()
    rows = re.findall(r"^\| \d \| `([a-z_]+)/` \|", readme, flags=re.MULTILINE)
    assert sorted(rows) == sorted(PACKAGES)
