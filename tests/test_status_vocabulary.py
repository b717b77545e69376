"""One status vocabulary: results/schema.py names the status kinds, and the rest of the package
uses those names, never a literal "ok"."""
from __future__ import annotations

import ast
from pathlib import Path

from speedbench.results import schema

PACKAGE = Path(schema.__file__).resolve().parents[1]


def ok_literals(path: Path) -> list[int]:
    """Lines of `path` with the string "ok" anywhere but as a subscript key (a counter's)."""
    tree = ast.parse(path.read_text())
    keys = {id(node.slice) for node in ast.walk(tree) if isinstance(node, ast.Subscript)}
    return [node.lineno for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and node.value == "ok" and id(node) not in keys]


def test_no_ok_status_literal_outside_results():
    found = {str(p.relative_to(PACKAGE)): lines for p in sorted(PACKAGE.rglob("*.py"))
             if "results" not in p.relative_to(PACKAGE).parts and (lines := ok_literals(p))}
    assert found == {}, f'use schema.OK instead of "ok": {found}'


def test_the_check_sees_a_literal(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text('ok = rows[rows["status"] == "ok"]\ncounters["frames"]["ok"]\n')
    assert ok_literals(bad) == [1]

