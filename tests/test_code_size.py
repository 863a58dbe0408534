"""Size limits on the code: no function over 80 lines, no module over 450 lines.

A function's size is its ``def`` line (decorators included) to its last line; a nested function counts inside its
outer one and on its own. Modules are every ``*.py`` file under the package, the benchmarks, the scripts, the
examples and the tests."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TREES = ("splitproof", "benchmarks", "scripts", "examples", "tests")
MAX_FUNCTION_LINES = 80
MAX_MODULE_LINES = 450


def _files() -> list[Path]:
    return sorted(p for tree in TREES for p in (ROOT / tree).rglob("*.py"))


def _functions(path: Path) -> list[tuple[str, int]]:
    """(qualified name, lines) of every function and method in ``path``."""
    out = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                first = min([child.lineno, *(d.lineno for d in child.decorator_list)])
                out.append((f"{prefix}{child.name}", child.end_lineno - first + 1))
                visit(child, f"{prefix}{child.name}.")
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")
            else:
                visit(child, prefix)

    visit(ast.parse(path.read_text(encoding="utf-8")), "")
    return out


def test_the_trees_hold_code():
    """The size checks below look at something: each tree exists and holds Python files."""
    for tree in TREES:
        assert list((ROOT / tree).rglob("*.py")), f"{tree}/ holds no Python file"


@pytest.mark.parametrize("tree", TREES)
def test_no_module_over_the_limit(tree):
    over = []
    for path in _files():
        if path.relative_to(ROOT).parts[0] != tree:
            continue
        lines = len(path.read_text(encoding="utf-8").splitlines())
        if lines > MAX_MODULE_LINES:
            over.append(f"{path.relative_to(ROOT)}: {lines} lines")
    assert not over, f"modules over {MAX_MODULE_LINES} lines (split them by concept): {over}"


@pytest.mark.parametrize("tree", TREES)
def test_no_function_over_the_limit(tree):
    over = []
    for path in _files():
        if path.relative_to(ROOT).parts[0] != tree:
            continue
        for name, lines in _functions(path):
            if lines > MAX_FUNCTION_LINES:
                over.append(f"{path.relative_to(ROOT)}::{name}: {lines} lines")
    assert not over, f"functions over {MAX_FUNCTION_LINES} lines (split them): {over}"


def test_the_function_measure_counts_decorators_and_nesting(tmp_path):
    """The measure itself: a decorated function's size starts at its first decorator; a nested one is found."""
    source = (
        "@decorator\ndef outer():\n    def inner():\n        return 1\n\n    return inner\n\n\n"
        "class C:\n    def m(self):\n        pass\n"
    )
    path = tmp_path / "sample.py"
    path.write_text(source, encoding="utf-8")
    assert _functions(path) == [("outer", 6), ("outer.inner", 2), ("C.m", 2)]
