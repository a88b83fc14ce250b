"""The suite's own check (issue 70): a test function that cannot fail is a defect. An AST scan of
every ``tests/test_*.py``: each test function asserts, expects an exception (``pytest.raises``,
``pytest.fail``, ``pytest.warns``), or calls a helper defined in a module of ``tests/`` that does (the
helper's own calls followed to a fixed point, e.g. ``run_torchrun``, which fails the test on a non-zero
exit). The workers under ``tests/dist/`` do not count: they run in processes of their own, and a call a
test makes by one of their names (``main``, ``check``) is another function's."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent
CHECKS = {"raises", "fail", "warns", "deprecated_call", "importorskip"}


def _called(node: ast.AST) -> set[str]:
    """The names of everything ``node`` calls (``f(...)`` -> f, ``a.b.f(...)`` -> f)."""
    names = set()
    for n in ast.walk(node):
        if isinstance(n, ast.Call):
            f = n.func
            names.add(f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else "")
    return names - {""}


def _checks_itself(fn: ast.AST) -> bool:
    """An ``assert`` statement, a call to ``pytest.raises/fail/warns``, or to an ``assert_*``
    function (``torch.testing.assert_close``, ``numpy.testing.assert_allclose``)."""
    for n in ast.walk(fn):
        if isinstance(n, ast.Assert):
            return True
        if isinstance(n, ast.Call) and isinstance(n.func, (ast.Name, ast.Attribute)) \
                and (n.func.id if isinstance(n.func, ast.Name) else n.func.attr).startswith("assert"):
            return True
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr in CHECKS \
                and isinstance(n.func.value, ast.Name) and n.func.value.id == "pytest":
            return True
    return False


def _functions() -> dict[Path, list[ast.FunctionDef]]:
    found = {}
    for path in sorted(TESTS.glob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        found[path] = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    return found


def checking_helpers(functions: dict[Path, list[ast.FunctionDef]]) -> set[str]:
    """Names of the functions in ``tests/*.py`` that check (assert, ``pytest.fail``...) or call one
    that does, to a fixed point. A name defined twice counts when any definition checks."""
    defs = [fn for fns in functions.values() for fn in fns]
    checking = {fn.name for fn in defs if _checks_itself(fn)}
    while True:
        more = {fn.name for fn in defs if fn.name not in checking and _called(fn) & checking}
        if not more:
            return checking
        checking |= more


def unchecked_tests() -> list[str]:
    functions = _functions()
    checking = checking_helpers(functions)
    bad = []
    for path, fns in functions.items():
        if not path.name.startswith("test_"):
            continue
        for fn in fns:
            if fn.name.startswith("test_") and not (_checks_itself(fn) or _called(fn) & checking):
                bad.append(f"{path.relative_to(TESTS.parent)}:{fn.lineno} {fn.name}")
    return bad


def test_every_test_function_can_fail():
    bad = unchecked_tests()
    assert not bad, "test functions that neither assert, nor expect an exception, nor call a checking helper:\n" + \
        "\n".join(bad)


def test_the_scan_finds_a_test_that_cannot_fail(tmp_path):
    """The scan itself, on made-up tests: one bare, one through a checking helper, one raising, one
    with ``torch.testing.assert_close``."""
    src = ("import pytest\n"
           "def helper(x):\n    assert x\n"
           "def wrapper(x):\n    helper(x)\n"
           "def test_bare():\n    print(1)\n"
           "def test_helped():\n    wrapper(1)\n"
           "def test_raises():\n    with pytest.raises(ValueError):\n        int('a')\n"
           "def test_close():\n    torch.testing.assert_close(1.0, 1.0)\n")
    fns = [n for n in ast.walk(ast.parse(src)) if isinstance(n, ast.FunctionDef)]
    checking = checking_helpers({tmp_path / "test_x.py": fns})
    assert checking == {"helper", "wrapper", "test_helped", "test_raises", "test_close"}
    verdict = {fn.name: _checks_itself(fn) or bool(_called(fn) & checking) for fn in fns if fn.name.startswith("test_")}
    assert verdict == {"test_bare": False, "test_helped": True, "test_raises": True, "test_close": True}


def _heavy_mark(fn: ast.FunctionDef) -> ast.expr | None:
    """``fn``'s ``@pytest.mark.heavy`` / ``@pytest.mark.heavy(...)`` decorator, or None."""
    for d in fn.decorator_list:
        target = d.func if isinstance(d, ast.Call) else d
        if isinstance(target, ast.Attribute) and target.attr == "heavy":
            return d
    return None


def heavy_pairs() -> list[tuple[str, str]]:
    """(heavy test, its cheap representative) for every test marked ``heavy``, as
    ``tests/<file>.py::<function>``; a heavy test naming none pairs with ''."""
    pairs = []
    for path in sorted(TESTS.glob("test_*.py")):
        for fn in ast.parse(path.read_text()).body:
            if isinstance(fn, ast.FunctionDef) and (mark := _heavy_mark(fn)) is not None:
                cheap = next((k.value.value for k in getattr(mark, "keywords", []) if k.arg == "cheap"), "")
                pairs.append((f"tests/{path.name}::{fn.name}", cheap))
    return pairs


def pairs_table() -> str:
    """The table of docs/development.md: each heavy test and the test that runs its path everywhere."""
    rows = ["| heavy test | a cheaper test of the same path |", "|---|---|"]
    rows += [f"| `{h.removeprefix('tests/')}` | `{c.removeprefix('tests/')}` |" for h, c in heavy_pairs()]
    return "\n".join(rows)


def test_every_heavy_test_names_a_cheap_test_that_runs_everywhere():
    """``@pytest.mark.heavy(cheap="tests/<file>.py::<test>")``: the representative exists, is a test,
    and is not heavy itself; docs/development.md lists the pairs (``python -m tests.test_meta``
    prints the table)."""
    pairs = heavy_pairs()
    assert len(pairs) >= 30, pairs
    for heavy, cheap in pairs:
        assert cheap, f"{heavy} names no cheap representative: @pytest.mark.heavy(cheap='tests/...::test_...')"
        file, _, name = cheap.partition("::")
        path = TESTS.parent / file
        assert path.exists(), (heavy, cheap)
        fns = {fn.name: fn for fn in ast.parse(path.read_text()).body if isinstance(fn, ast.FunctionDef)}
        assert name.startswith("test_") and name in fns, f"{heavy}: no test {cheap}"
        assert _heavy_mark(fns[name]) is None, f"{heavy}: its representative {cheap} is heavy too"
    assert pairs_table() in (TESTS.parent / "docs" / "development.md").read_text(), \
        "docs/development.md: paste python -m tests.test_meta's table"


if __name__ == "__main__":
    print(pairs_table())
