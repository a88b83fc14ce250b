"""Threads per process on a CPU-only run (launchers/common.cpu_threads): the host's CPUs shared
among its processes, or MEGALIGN_CPU_THREADS where several "nodes" share one host."""

from __future__ import annotations

import os

import pytest

from alignment.schema import ConfigError
from launchers.common import cpu_threads


def test_threads_follow_the_processes_on_the_host_or_the_variable(monkeypatch):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    monkeypatch.delenv("MEGALIGN_CPU_THREADS", raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert cpu_threads(4) == 4  # all 4 ranks on this host
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert cpu_threads(4) == 8
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "32")
    assert cpu_threads(64) == 1  # never 0
    monkeypatch.setenv("MEGALIGN_CPU_THREADS", "3")
    assert cpu_threads(64) == 3
    for bad in ("0", "two", "-1"):
        monkeypatch.setenv("MEGALIGN_CPU_THREADS", bad)
        with pytest.raises(ConfigError, match=f"MEGALIGN_CPU_THREADS='{bad}': give a positive number"):
            cpu_threads(1)
