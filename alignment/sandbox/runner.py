"""Running untrusted code (a policy's Python, a task's unit tests) for a reward: each run is a
fresh process in its own temporary directory, with a wall-clock limit, CPU-time, memory, file-size
and process limits (``resource.setrlimit``), no network (a new network namespace where the kernel
allows one, and sockets refused by an audit hook either way), no new processes, no writes outside
its directory, and capped output. A crash, an infinite loop, a fork bomb or a memory bomb ends that
run with a failed :class:`SandboxResult` and nothing else; :class:`SandboxPool` runs several at
once so scoring overlaps with generation.

Layers (what each limit rests on; :mod:`alignment.sandbox.child` sets them up):

| threat | stopped by |
|---|---|
| infinite loop, ``sleep`` | wall clock (the whole process group killed), ``RLIMIT_CPU`` |
| memory bomb | ``RLIMIT_AS`` (``MemoryError``) |
| output flood | ``RLIMIT_FSIZE`` on its stdout / stderr files, and only ``output_bytes`` read back |
| fork bomb, ``subprocess`` | the audit hook (no fork / exec / spawn), ``RLIMIT_NPROC`` (not root), the PID namespace |
| network | the network namespace (no interface up) and the audit hook (no sockets) |
| writes elsewhere | the audit hook (``open`` for writing, remove, rename, mkdir... outside the directory) |
| ``ctypes`` to get around the hook | the hook refuses ``ctypes`` calls |

Not a container: the code runs as the calling user, and what the audit hook does not see (a C
extension doing system calls) is limited only by the resource limits and namespaces. Run the job
itself in a container for code from outside. As HumanEval's ``execution.py`` and verl's
``sandbox_fusion`` do, the code runs with Python's standard library only (``python -I -S``).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from functools import lru_cache
from pathlib import Path

CHILD = Path(__file__).with_name("child.py")

__all__ = ["SandboxLimits", "SandboxResult", "run_python", "SandboxPool", "network_isolation"]


@dataclass(frozen=True)
class SandboxLimits:
    """Per-run limits: ``wall_seconds`` (s, the whole run), ``cpu_seconds`` (s of CPU), ``memory_mb``
    (MiB of address space), ``file_bytes`` (largest file, stdout and stderr included), ``output_bytes``
    (of stdout and of stderr read back), ``processes`` (``RLIMIT_NPROC``; enforced for non-root users)."""

    wall_seconds: float = 10.0
    cpu_seconds: int = 10
    memory_mb: int = 512
    file_bytes: int = 1 << 20
    output_bytes: int = 1 << 16
    processes: int = 64

    def check(self) -> None:
        """Raises ValueError naming a limit that is not positive."""
        for name, value in asdict(self).items():
            if not value > 0:
                raise ValueError(f"sandbox limit {name}={value} must be > 0")


@dataclass
class SandboxResult:
    """How a run ended: ``returncode`` (0: success; 128 + N: killed by signal N; None: killed at the
    wall-clock limit), ``stdout`` / ``stderr`` (at most ``output_bytes`` each, decoded with
    replacement), ``timed_out``, ``truncated`` (more output than was read back) and ``seconds``."""

    returncode: int | None
    stdout: str
    stderr: str
    timed_out: bool
    truncated: bool
    seconds: float

    @property
    def ok(self) -> bool:
        """Ran to the end with exit status 0 within the limits."""
        return self.returncode == 0 and not self.timed_out


@lru_cache(maxsize=1)
def network_isolation() -> bool:
    """Whether this kernel gives the sandbox its own network namespace (no network at all); without
    one, sockets are still refused by the audit hook. Probed once."""
    probe = ("import ctypes, os, sys; flags = 0x40000000 | (0 if os.geteuid() == 0 else 0x10000000); "
             "sys.exit(ctypes.CDLL(None, use_errno=True).unshare(flags) != 0)")
    return subprocess.run([sys.executable, "-I", "-S", "-c", probe], capture_output=True).returncode == 0


def _read(path: Path, cap: int) -> tuple[str, bool]:
    with open(path, "rb") as f:
        data = f.read(cap + 1)
    return data[:cap].decode("utf-8", errors="replace"), len(data) > cap


def run_python(code: str, limits: SandboxLimits = SandboxLimits(), stdin: str = "") -> SandboxResult:
    """Run the Python source ``code`` as ``__main__`` in the sandbox (module docstring) with ``stdin``.

    Raises:
        ValueError: a limit that is not positive.
    """
    limits.check()
    work, logs = Path(tempfile.mkdtemp(prefix="megalign_sandbox_")), Path(tempfile.mkdtemp(prefix="megalign_logs_"))
    start = time.perf_counter()
    timed_out = False
    try:
        (work / "main.py").write_text(code)
        env = {"PATH": "/usr/bin:/bin", "HOME": str(work), "TMPDIR": str(work), "LANG": "C.UTF-8",
               "PYTHONHASHSEED": "0", "PYTHONDONTWRITEBYTECODE": "1"}
        with open(logs / "stdout", "wb") as out, open(logs / "stderr", "wb") as err:
            proc = subprocess.Popen([sys.executable, "-I", "-S", str(CHILD), json.dumps(asdict(limits)), "main.py",
                                     str(os.getpid())],
                                    cwd=work, env=env, stdin=subprocess.PIPE, stdout=out, stderr=err,
                                    start_new_session=True)
            try:
                proc.communicate(stdin.encode(), timeout=limits.wall_seconds)
            except subprocess.TimeoutExpired:
                timed_out = True
            finally:
                try:  # the launcher's whole process group: the namespace's init goes, and all in it
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait()
        stdout, cut_out = _read(logs / "stdout", limits.output_bytes)
        stderr, cut_err = _read(logs / "stderr", limits.output_bytes)
        return SandboxResult(None if timed_out else proc.returncode, stdout, stderr, timed_out, cut_out or cut_err,
                             time.perf_counter() - start)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(logs, ignore_errors=True)


def sandbox_workers() -> int:
    """Sandbox runs at once per process: this node's cores shared by its local ranks (at least 1)."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return max(1, (os.cpu_count() or 1) // max(local, 1))


class SandboxPool:
    """Runs up to ``workers`` sandboxes at once (threads waiting on processes), so rewards that run
    code are computed while the engine generates: :meth:`submit` returns at once.

    Args:
        workers: concurrent runs (>= 1); each is a process of its own.
        limits: the limits of every run.
    Raises:
        ValueError: ``workers < 1`` or a limit that is not positive.
    """

    def __init__(self, workers: int = 2, limits: SandboxLimits = SandboxLimits()):
        if workers < 1:
            raise ValueError(f"sandbox workers={workers} must be >= 1")
        limits.check()
        self.limits = limits
        self._executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="sandbox")

    def submit(self, code: str, stdin: str = "") -> Future:
        """A future of the :class:`SandboxResult` of ``code``."""
        return self._executor.submit(run_python, code, self.limits, stdin)

    def map(self, codes: list[str]) -> list[SandboxResult]:
        """The results of ``codes``, in order (run concurrently)."""
        return [f.result() for f in [self.submit(c) for c in codes]]

    def close(self) -> None:
        self._executor.shutdown(wait=True)

    def __enter__(self) -> SandboxPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
