"""The library's shape: no module over 400 lines and no function over 60, so each file keeps one job and each
function stays readable at a glance. A failure names every file and function over its limit and its size."""

from __future__ import annotations

import ast
from pathlib import Path

LIBRARY = Path(__file__).resolve().parents[2] / "stk"
MAX_FILE_LINES = 400
MAX_FUNCTION_LINES = 60


def _library_files() -> list[Path]:
    return sorted(LIBRARY.rglob("*.py"))


def _name(path: Path) -> str:
    return str(path.relative_to(LIBRARY.parent))


def _long_functions(path: Path) -> list[str]:
    """Each function or method over the limit, counted from its `def` line to its last (decorators excluded)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            lines = (node.end_lineno or node.lineno) - node.lineno + 1
            if lines > MAX_FUNCTION_LINES:
                found.append(f"{_name(path)}:{node.lineno} {node.name}: {lines} lines")
    return found


def test_the_library_is_found() -> None:
    assert len(_library_files()) > 50


def test_no_library_file_is_over_the_limit() -> None:
    long_files = [
        f"{_name(path)}: {count} lines"
        for path in _library_files()
        if (count := len(path.read_text().splitlines())) > MAX_FILE_LINES
    ]
    assert not long_files, f"over {MAX_FILE_LINES} lines, split by meaning:\n" + "\n".join(long_files)


def test_no_library_function_is_over_the_limit() -> None:
    long_functions = [entry for path in _library_files() for entry in _long_functions(path)]
    assert not long_functions, f"over {MAX_FUNCTION_LINES} lines:\n" + "\n".join(long_functions)
