"""The type checker passes where pyproject.toml's [tool.mypy] runs it (strict: the algorithms, their checks, every
trainer and the loop)."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import ROOT


def test_mypy_strict_passes():
    out = subprocess.run([sys.executable, "-m", "mypy", "--no-incremental", "--cache-dir", "/dev/null"], cwd=ROOT,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and out.stdout.startswith("Success: no issues found"), out.stdout + out.stderr
