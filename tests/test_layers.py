"""The layers (docs/concepts.md, CONTRIBUTING.md): ``parallel`` <- ``alignment`` <- ``launchers`` <-
``tools`` / ``bench``, each folder importing only the folders below it, checked by import-linter's
contracts in ``pyproject.toml`` (with a negative control: an upward import breaks them); and no
module imports another module's ``_private`` name."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("parallel", "alignment", "launchers", "tools", "bench")


def lint_imports(root: Path) -> subprocess.CompletedProcess:
    """``lint-imports`` (import-linter) on the project at ``root`` with its ``pyproject.toml``."""
    exe = Path(sys.executable).parent / "lint-imports"
    return subprocess.run([str(exe), "--no-cache", "pyproject.toml"], cwd=root,
                          capture_output=True, text=True, timeout=120)


def test_import_contracts_are_kept():
    proc = lint_imports(ROOT)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "0 broken" in proc.stdout and "KEPT" in proc.stdout


@pytest.mark.parametrize("module, added, broken", [
    # the arrow the evaluation suites once had (alignment -> launchers)
    ("alignment/cache.py", "import launchers.preflight", "folders import downwards only"),
    # data below the rewards: the arrow the code tasks once had
    ("alignment/data/code_tasks.py", "import alignment.rewards.graders", "alignment's subpackages import downwards only"),
    # launchers.train already imports launchers.console
    ("launchers/console.py", "import launchers.train", "no import cycles"),
])
def test_an_upward_import_or_a_cycle_breaks_a_contract(tmp_path, module, added, broken):
    """The negative controls: each added import fails the check, in the contract named (an upward
    import also closes a cycle, so that contract may break with it)."""
    for pkg in PACKAGES:
        shutil.copytree(ROOT / pkg, tmp_path / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    path = tmp_path / module
    path.write_text(path.read_text() + f"\n{added}  # noqa: E402\n")
    proc = lint_imports(tmp_path)
    assert proc.returncode != 0, proc.stdout[-3000:]
    assert f"{broken}" in proc.stdout.split("Broken contracts")[1], proc.stdout[-3000:]


def private_imports(module: str, source: str) -> list[str]:
    """``from <project module> import _name`` statements in ``source`` (the module ``module``,
    dotted) that take a private name of another project module, as ``"module: from X import _y"``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.ImportFrom) or node.level or not node.module:
            continue
        if node.module.split(".")[0] not in PACKAGES or node.module == module:
            continue
        found += [f"{module}: from {node.module} import {a.name}" for a in node.names
                  if a.name.startswith("_") and not a.name.startswith("__")]
    return found


def test_no_module_imports_another_modules_private_name():
    assert private_imports("alignment.models.x", "from alignment.models.weights import _tp, share\n"
                                                 "from alignment.models.x import _mine\nfrom os import _exit\n") == \
        ["alignment.models.x: from alignment.models.weights import _tp"]
    found = []
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            module = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
            found += private_imports(module, path.read_text())
    assert not found, "\n".join(found)
