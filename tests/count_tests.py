"""The suite's size, the one figure the docs give of it (docs/getting-started.md; a test in
tests/test_docs.py keeps it true):

    python -m tests.count_tests

collects every test (``pytest --collect-only`` with this module as a plugin) and prints the sentence.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COUNT_FILE = "MEGALIGN_COUNT_FILE"


def pytest_collection_finish(session) -> None:
    """As a plugin: the collected tests by tier, written to ``$MEGALIGN_COUNT_FILE``."""
    path = os.environ.get(COUNT_FILE)
    if not path:
        return
    items = session.items
    counts = {"tests": len(items), "slow": sum("slow" in i.keywords for i in items),
              "heavy": sum("heavy" in i.keywords for i in items),
              "gpu": sum(Path(str(i.fspath)).name == "test_gpu.py" for i in items)}
    Path(path).write_text(json.dumps(counts))


def counts() -> dict[str, int]:
    """``{"tests", "slow", "heavy", "gpu"}`` of the whole suite (a collection in a subprocess)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "counts.json"
        subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "tests.count_tests",
                        "-p", "no:cacheprovider", "tests"], cwd=ROOT, check=True, capture_output=True,
                       env={**os.environ, COUNT_FILE: str(out), "PYTHONPATH": str(ROOT)})
        return json.loads(out.read_text())


def sentence(c: dict[str, int]) -> str:
    return (f"{c['tests']:,} tests: {c['tests'] - c['slow']:,} in the fast tier, {c['slow']} in the slow tier "
            f"({c['heavy']} of them heavy, {c['gpu']} that need a GPU)")


if __name__ == "__main__":
    print(sentence(counts()))
