"""Shared test helpers: launching torchrun workers on CPU (gloo)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run_torchrun(worker: str, *args: str, nproc: int = 2, timeout: int = 900, env: dict | None = None) -> str:
    """Run ``tests/dist/<worker>`` under torchrun with ``nproc`` CPU processes; return its output.
    Fails the test with the tail of the log when the workers fail."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           str(ROOT / "tests" / "dist" / worker), *args]
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **(env or {})}
    proc = subprocess.run(cmd, cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=timeout)
    out = proc.stdout + proc.stderr
    if proc.returncode != 0:
        pytest.fail(f"{worker} failed (exit {proc.returncode}):\n{out[-6000:]}")
    return out


@pytest.fixture
def torchrun_json(tmp_path):
    """Run a worker that writes a JSON result file as its last argument; return the parsed JSON."""

    def _run(worker: str, *args: str, nproc: int = 2, **kw):
        path = tmp_path / f"{Path(worker).stem}.json"
        run_torchrun(worker, *args, str(path), nproc=nproc, **kw)
        return json.loads(path.read_text())

    return _run
