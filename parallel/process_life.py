"""A process that dies with its parent: ``prctl(PR_SET_PDEATHSIG, SIGKILL)`` (Linux), so that a rank's
helpers (Megatron's checkpoint-writer manager; :mod:`parallel.cpu_compat`) and the ranks themselves
(:mod:`launchers.job_guard`) never outlive what started them, whatever kills it. Standard library
only: it runs first thing in spawned helper processes."""

from __future__ import annotations

import ctypes
import os
import signal

PR_SET_PDEATHSIG = 1  # linux/prctl.h


def die_with_parent(parent: int | None = None) -> bool:
    """Have the kernel SIGKILL this process when its parent dies (when the thread that started it
    exits). ``parent``: the pid it should have now (default: whatever it has); if it has another,
    the parent died before the request was made, and this process is killed at once. Returns
    whether the request was made (False where ``prctl`` is missing)."""
    parent = os.getppid() if parent is None else parent
    try:
        if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL) != 0:
            return False
    except (OSError, AttributeError):  # not Linux
        return False
    if os.getppid() != parent:
        os.kill(os.getpid(), signal.SIGKILL)
    return True
