"""The size rules of ../shared/ARCHITECTURE.md §2, held for every source package.

A module over 600 lines is two modules; a function over 100 lines is several,
unless its docstring says why it is not (it names its length: "... lines because ...").
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("assets", "resources", "instance", "pipelines", "trainyard", "training", "common", "bench", "deploy")
MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 100


def sources() -> list[Path]:
    return sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py"))


def oversized(path: Path) -> list[str]:
    text = path.read_text()
    found = []
    if text.count("\n") > MAX_MODULE_LINES:
        found.append(f"{path.relative_to(ROOT)}: {text.count(chr(10))} lines (at most {MAX_MODULE_LINES})")
    for node in ast.walk(ast.parse(text, filename=str(path))):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            length = (node.end_lineno or node.lineno) - node.lineno + 1
            reason = "lines because" in (ast.get_docstring(node) or "")
            if length > MAX_FUNCTION_LINES and not reason:
                found.append(
                    f"{path.relative_to(ROOT)}:{node.lineno} {node.name}: {length} lines (at most {MAX_FUNCTION_LINES})"
                )
    return found


def test_no_module_or_function_too_long() -> None:
    assert [line for p in sources() for line in oversized(p)] == []


def test_the_rule_sees_a_long_function(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    long_fn = tmp_path / "m.py"
    long_fn.write_text(f"def f():\n{body}\n")
    assert oversized(long_fn) == [f"m.py:1 f: {MAX_FUNCTION_LINES + 1} lines (at most {MAX_FUNCTION_LINES})"]
    long_fn.write_text(f'def f():\n    """Kept whole: 101 lines because it is one table."""\n{body}\n')
    assert oversized(long_fn) == []
