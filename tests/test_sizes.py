"""Sizes: no file of moe_perf/ over MAX_FILE_LINES lines and no function over
MAX_FUNCTION_LINES, read from the source (AST), and a proof that the check can fail.

A function's length runs from its `def` (decorators left out) to its last line, docstring and
comments included: what a reader has to hold at once. A nested function counts inside its
parent and on its own.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_FILE_LINES = 400
MAX_FUNCTION_LINES = 60


def oversized(root: Path, package: str = "moe_perf", exempt=frozenset()) -> list[str]:
    """Every file and function under `root/package` over its limit, one line each."""
    problems = []
    for path in sorted((root / package).rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel in exempt:
            continue
        text = path.read_text(encoding="utf-8")
        lines = len(text.splitlines())
        if lines > MAX_FILE_LINES:
            problems.append(f"{rel}: {lines} lines (at most {MAX_FILE_LINES})")
        for node in ast.walk(ast.parse(text, filename=rel)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    problems.append(f"{rel}:{node.lineno}: {node.name} is {length} lines "
                                    f"(at most {MAX_FUNCTION_LINES})")  # fmt: skip
    return problems


def test_no_file_or_function_of_the_package_is_oversized():
    assert oversized(ROOT) == []


def test_the_checker_reports_an_oversized_file_and_function(tmp_path):
    """A planted package: a long file, a long function (nested in a class), an exempt file and
    a function exactly at the limit; only the two breaks are reported, with their lines."""
    pkg = tmp_path / "moe_perf"
    pkg.mkdir()
    (pkg / "long.py").write_text("x = 1\n" * (MAX_FILE_LINES + 1))
    body = "".join("    y = 1\n" for _ in range(MAX_FUNCTION_LINES))  # def + 60 = 61 lines
    method = body.replace("    ", "        ")
    (pkg / "func.py").write_text(f"class C:\n    def big(self):\n{method}")
    at_limit = "".join("    y = 1\n" for _ in range(MAX_FUNCTION_LINES - 1))
    (pkg / "ok.py").write_text(f"def fits():\n{at_limit}")
    (pkg / "exempt.py").write_text("x = 1\n" * (MAX_FILE_LINES + 1))
    problems = oversized(tmp_path, exempt={"moe_perf/exempt.py"})
    assert problems == [
        f"moe_perf/func.py:2: big is {MAX_FUNCTION_LINES + 1} lines (at most {MAX_FUNCTION_LINES})",
        f"moe_perf/long.py: {MAX_FILE_LINES + 1} lines (at most {MAX_FILE_LINES})",
    ]
