"""Running untrusted code (a policy's Python, a task's unit tests) for a reward: each run is a
fresh process in a container of its own (bubblewrap, :mod:`alignment.sandbox.bwrap`) with a
wall-clock limit, CPU-time, memory, file-size, disk and process limits (``resource.setrlimit``, a
size-limited tmpfs), no network, no other process in sight, a read-only system and an unprivileged
uid, plus an audit hook that refuses new processes, sockets, ``ctypes`` and writes outside its
directory with a clear reason. A crash, an infinite loop, a fork bomb or a memory bomb ends that run
with a failed :class:`SandboxResult` (its :attr:`SandboxResult.reason` says which limit ended it)
and nothing else; :class:`SandboxPool` runs several at once so scoring overlaps with generation.

Layers (what each threat meets, in the container; :mod:`alignment.sandbox.child` sets up the inner ones):

| threat | stopped by |
|---|---|
| infinite loop, ``sleep`` | wall clock (the whole container killed), ``RLIMIT_CPU`` |
| memory bomb | ``RLIMIT_AS`` (``MemoryError``) |
| output flood | ``RLIMIT_FSIZE`` on its stdout / stderr files, and only ``output_bytes`` read back |
| disk fill | the tmpfs size (``disk_mb``), ``RLIMIT_FSIZE`` per file |
| fork bomb, thread bomb, ``subprocess`` | the audit hook (no fork / exec / spawn), ``RLIMIT_NPROC`` on an unprivileged uid, the PID namespace (all die with the run) |
| network | the network namespace (its own loopback only) and the audit hook (no sockets) |
| reading secrets (``/etc/shadow``, the job's files, other processes' ``/proc``) | not mounted; the PID namespace |
| writes elsewhere | a read-only system and the audit hook |
| ``ctypes``, ``__builtins__`` tricks against the hook | the hook refuses ``ctypes``; the container does not rely on the hook |

The audit hook (PEP 578) is a tripwire that gives readable reasons, not a boundary: Python code can
get around it, which is why the container is there. Where bubblewrap cannot run
(:func:`alignment.sandbox.bwrap.probe` says why), a run falls back, with a logged warning, to the
child's own network and PID namespaces, the same limits and the hook: then the code runs as the
calling user, can read what that user can, and as root ``RLIMIT_NPROC`` does not bind. As
HumanEval's ``execution.py`` and verl's ``sandbox_fusion`` do, the code runs with Python's standard
library only (``python -I -S``).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from functools import lru_cache
from pathlib import Path

from alignment.sandbox import bwrap

CHILD = Path(__file__).with_name("child.py")
ISOLATIONS = ("bwrap", "namespaces")
logger = logging.getLogger(__name__)

__all__ = ["SandboxLimits", "SandboxResult", "run_python", "SandboxPool", "network_isolation", "default_isolation",
           "ISOLATIONS"]


@dataclass(frozen=True)
class SandboxLimits:
    """Per-run limits: ``wall_seconds`` (s, the whole run), ``cpu_seconds`` (s of CPU), ``memory_mb``
    (MiB of address space), ``file_bytes`` (largest file, stdout and stderr included), ``output_bytes``
    (of stdout and of stderr read back), ``processes`` (``RLIMIT_NPROC``: processes and threads of the
    run's uid; binds as root only in the bwrap container), ``disk_mb`` (MiB of each of the container's
    tmpfs, ``/sandbox`` and ``/tmp``)."""

    wall_seconds: float = 10.0
    cpu_seconds: int = 10
    memory_mb: int = 512
    file_bytes: int = 1 << 20
    output_bytes: int = 1 << 16
    processes: int = 64
    disk_mb: int = 64

    def check(self) -> None:
        """Raises ValueError naming a limit that is not positive."""
        for name, value in asdict(self).items():
            if not value > 0:
                raise ValueError(f"sandbox limit {name}={value} must be > 0")


@dataclass
class SandboxResult:
    """How a run ended: ``returncode`` (0: success; 128 + N: killed by signal N; None: killed at the
    wall-clock limit), ``stdout`` / ``stderr`` (at most ``output_bytes`` each, decoded with
    replacement), ``timed_out``, ``truncated`` (more output than was read back), ``seconds`` and
    ``isolation`` (``bwrap`` or ``namespaces``: what it ran in)."""

    returncode: int | None
    stdout: str
    stderr: str
    timed_out: bool
    truncated: bool
    seconds: float
    isolation: str = "bwrap"

    @property
    def ok(self) -> bool:
        """Ran to the end with exit status 0 within the limits."""
        return self.returncode == 0 and not self.timed_out

    @property
    def reason(self) -> str:
        """Why the run ended, in a few words: ``ok``, or the limit or layer that stopped it (``wall
        clock: ...``, ``CPU time limit (SIGXCPU)``, ``memory limit: MemoryError``, ``refused by the
        audit hook: PermissionError: sandbox: os.fork is not allowed``, ``read-only file system:
        ...``) with the last line of stderr, else its exit status and that line."""
        if self.ok:
            return "ok"
        if self.timed_out:
            return f"wall clock: killed after {self.seconds:.1f} s"
        lines = self.stderr.strip().splitlines()
        last = lines[-1] if lines else ""
        if self.returncode is not None and self.returncode > 128:
            name = signal.Signals(self.returncode - 128).name if self.returncode - 128 in _SIGNALS else "a signal"
            return {"SIGXCPU": "CPU time limit (SIGXCPU)", "SIGXFSZ": "file size limit (SIGXFSZ)"}.get(
                name, f"killed by {name}")
        for marker, why in _ERRORS:
            if marker in last:
                if marker == "[Errno 2]" and self.isolation != "bwrap":
                    why = "no such file"
                return f"{why}: {last}"
        return f"exit status {self.returncode}" + (f": {last}" if last else "")


_SIGNALS = {s.value for s in signal.Signals}
_ERRORS = (("PermissionError: sandbox:", "refused by the audit hook"), ("MemoryError", "memory limit"),
           ("[Errno 27]", "file size limit"), ("[Errno 28]", "disk limit"), ("[Errno 30]", "read-only file system"),
           ("[Errno 13]", "permission denied (unprivileged uid)"), ("[Errno 2]", "not in the container"),
           ("[Errno 11]", "process limit"), ("can't start new thread", "process limit"),
           ("[Errno 24]", "open files limit"), ("[Errno 3]", "no such process (PID namespace)"),
           ("[Errno 101]", "no network"), ("[Errno 111]", "connection refused (the container's own network)"),
           ("[Errno 1]", "not permitted"))


@lru_cache(maxsize=1)
def default_isolation() -> str:
    """``bwrap`` where bubblewrap runs here, else ``namespaces`` (logged once as a warning with
    bwrap's reason). Probed once per process."""
    why = bwrap.probe()
    if why is None:
        return "bwrap"
    logger.warning("sandbox: %s; untrusted code runs with the sandbox's own namespaces, limits and audit hook "
                   "instead, as the calling user (weaker: see alignment/sandbox/runner.py)", why)
    return "namespaces"


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


def run_python(code: str, limits: SandboxLimits = SandboxLimits(), stdin: str = "", *, isolation: str | None = None,
               audit_hook: bool = True) -> SandboxResult:
    """Run the Python source ``code`` as ``__main__`` in the sandbox (module docstring) with ``stdin``.

    Args:
        isolation: ``bwrap`` (the container), ``namespaces`` (the fallback) or None (the default:
            :func:`default_isolation`).
        audit_hook: False only to test the layers under it (a negative control).
    Raises:
        ValueError: a limit that is not positive, or an unknown ``isolation``.
        FileNotFoundError: ``isolation="bwrap"`` where bwrap is not installed.
    """
    limits.check()
    isolation = isolation or default_isolation()
    if isolation not in ISOLATIONS:
        raise ValueError(f"sandbox isolation={isolation!r}: expected one of {', '.join(ISOLATIONS)}")
    options = json.dumps({**asdict(limits), "audit_hook": audit_hook, "container": isolation == "bwrap"})
    env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "PYTHONHASHSEED": "0", "PYTHONDONTWRITEBYTECODE": "1"}
    logs = Path(tempfile.mkdtemp(prefix="megalign_logs_"))
    work, code_fd = None, -1
    start = time.perf_counter()
    timed_out = False
    try:
        if isolation == "bwrap":  # the program reaches /sandbox/main.py through a descriptor
            code_fd = os.memfd_create("megalign_sandbox_main")
            os.write(code_fd, code.encode())
            os.lseek(code_fd, 0, os.SEEK_SET)
            env.update(HOME=bwrap.SANDBOX_DIR, TMPDIR="/tmp")
            argv = bwrap.command(CHILD, code_fd, [options, "main.py", "1"], limits.disk_mb, env)
            cwd, popen_env, fds = logs, {}, (code_fd,)
        else:
            work = Path(tempfile.mkdtemp(prefix="megalign_sandbox_"))
            (work / "main.py").write_text(code)
            env.update(HOME=str(work), TMPDIR=str(work))
            argv = [sys.executable, "-I", "-S", str(CHILD), options, "main.py", str(os.getpid())]
            cwd, popen_env, fds = work, env, ()
        with open(logs / "stdout", "wb") as out, open(logs / "stderr", "wb") as err:
            proc = subprocess.Popen(argv, cwd=cwd, env=popen_env, stdin=subprocess.PIPE, stdout=out, stderr=err,
                                    pass_fds=fds, start_new_session=True)
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
                             time.perf_counter() - start, isolation)
    finally:
        if code_fd >= 0:
            os.close(code_fd)
        if work is not None:
            shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(logs, ignore_errors=True)


def sandbox_workers() -> int:
    """Sandbox runs at once per process: this node's cores shared by its local ranks (at least 1)."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return max(1, (os.cpu_count() or 1) // max(local, 1))


class SandboxPool:
    """Runs up to ``workers`` sandboxes at once (threads waiting on processes), so rewards that run
    code are computed while the engine generates: :meth:`prefetch` starts a program as soon as its
    answer exists, and the later :meth:`map` that grades it takes that run instead of starting
    another.

    Args:
        workers: concurrent runs (>= 1); each is a process of its own.
        limits: the limits of every run.
        isolation: as :func:`run_python`'s.
    Raises:
        ValueError: ``workers < 1`` or a limit that is not positive.
    """

    def __init__(self, workers: int = 2, limits: SandboxLimits = SandboxLimits(), isolation: str | None = None):
        if workers < 1:
            raise ValueError(f"sandbox workers={workers} must be >= 1")
        limits.check()
        self.limits = limits
        self.isolation = isolation
        self._executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="sandbox")
        self._started: dict[str, Future] = {}  # prefetched programs no map has taken yet
        self._lock = threading.Lock()
        #: programs :meth:`map` found already started by :meth:`prefetch`, and all it was asked for
        self.taken = self.asked = 0

    def submit(self, code: str, stdin: str = "") -> Future:
        """A future of the :class:`SandboxResult` of ``code``."""
        return self._executor.submit(run_python, code, self.limits, stdin, isolation=self.isolation)

    def prefetch(self, code: str) -> None:
        """Start ``code`` now (once: an identical program already started is not started again), for
        a later :meth:`map` to take."""
        with self._lock:
            if code not in self._started:
                self._started[code] = self.submit(code)

    def map(self, codes: list[str]) -> list[SandboxResult]:
        """The results of ``codes``, in order, run concurrently: a program :meth:`prefetch` started
        gives that run's result (and is taken: a later call runs it again), and identical programs
        in ``codes`` run once (with no input, a sandbox run depends on its program only:
        ``PYTHONHASHSEED=0``, nothing of the host in sight)."""
        futures: dict[str, Future] = {}
        with self._lock:
            for c in codes:
                if c not in futures:
                    started = self._started.pop(c, None)
                    self.taken += started is not None
                    futures[c] = started if started is not None else self.submit(c)
            self.asked += len(codes)
        return [futures[c].result() for c in codes]

    def close(self) -> None:
        """Wait for the runs under way (prefetched ones no map took are not started if still queued)."""
        with self._lock:
            for f in self._started.values():
                f.cancel()
            self._started.clear()
        self._executor.shutdown(wait=True)

    def __enter__(self) -> SandboxPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
