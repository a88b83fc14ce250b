"""The sandbox's launcher, run as ``python -I -S child.py LIMITS_JSON CODE_PATH PARENT_PID`` in the
sandbox's directory by :func:`alignment.sandbox.runner.run_python` (standard library only: it is
run without ``site``; ``PARENT_PID``: the process that started it). In order:

0. die with the parent (``prctl(PR_SET_PDEATHSIG, SIGKILL)``, again after each fork): a sandbox
   outlives neither the rank that started it nor, level by level, its own launcher, whatever kills them;
1. new network and PID namespaces (``unshare``; a user namespace too when not root), when the
   kernel allows: no interface but a down loopback, and every process the code starts dies with it;
2. fork twice: the child is the namespace's init, the grandchild runs the code; each parent waits
   and exits with its child's status (killed by signal N: 128 + N);
3. resource limits (CPU seconds, address space, file size, open files, processes, no core dumps);
4. an audit hook (PEP 578) that refuses, with ``PermissionError``: new processes (fork, exec,
   spawn, ``subprocess``), sockets, ``ctypes`` and writes, renames, removals outside the directory;
5. the code, as ``__main__``.
"""

import json
import os
import resource
import signal
import sys

CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
PR_SET_PDEATHSIG = 1
_PROCESS_EVENTS = ("os.fork", "os.forkpty", "os.posix_spawn", "os.exec", "os.system", "subprocess.Popen",
                   "os.kill", "os.killpg", "pty.spawn", "socket.__new__", "socket.connect", "socket.bind")
_PATH_EVENTS = ("os.remove", "os.rmdir", "os.rename", "os.mkdir", "os.symlink", "os.link", "os.chmod", "os.chown",
                "os.truncate", "os.utime", "shutil.rmtree", "shutil.move", "shutil.copyfile")
_BLOCKED_MODULES = ("ctypes", "_ctypes", "_posixsubprocess", "mmap", "_xxsubinterpreters")
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND


def die_with_parent(parent: int) -> None:
    """SIGKILL this process when its parent dies; exit at once if the parent, whose pid (as this
    process sees it) is ``parent``, is gone already. (``parallel.process_life.die_with_parent`` does
    the same for the project's processes; this file runs isolated, ``-I -S``, and imports nothing of it.)"""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:
        os._exit(128 + signal.SIGKILL)


def isolate() -> bool:
    """New network and PID namespaces for this process's next child; False when refused."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        flags = CLONE_NEWNET | CLONE_NEWPID | (0 if os.geteuid() == 0 else CLONE_NEWUSER)
        return libc.unshare(flags) == 0
    except (OSError, AttributeError):
        return False


def limit(limits: dict) -> None:
    cpu, memory, files = limits["cpu_seconds"], limits["memory_mb"] << 20, limits["file_bytes"]
    for name, value in ((resource.RLIMIT_CPU, (cpu, cpu + 1)), (resource.RLIMIT_AS, (memory, memory)),
                        (resource.RLIMIT_FSIZE, (files, files)), (resource.RLIMIT_NOFILE, (64, 64)),
                        (resource.RLIMIT_NPROC, (limits["processes"], limits["processes"])),
                        (resource.RLIMIT_CORE, (0, 0))):
        try:
            resource.setrlimit(name, value)
        except (ValueError, OSError):  # e.g. a hard limit already lower
            pass


def guard(root: str) -> None:
    """Install the audit hook (it cannot be removed)."""
    root = os.path.realpath(root)

    def inside(path) -> bool:
        if isinstance(path, int):
            return True  # an open descriptor: its file was checked when it was opened
        try:
            full = os.path.realpath(os.fsdecode(path))
        except (TypeError, ValueError):
            return False
        return full == root or full.startswith(root + os.sep)

    def hook(event, args):
        if event in _PROCESS_EVENTS or event.startswith("ctypes."):
            raise PermissionError(f"sandbox: {event} is not allowed")
        if event == "import" and args[0].split(".")[0] in _BLOCKED_MODULES:
            raise PermissionError(f"sandbox: importing {args[0]} is not allowed")
        if event == "open":
            path, mode, flags = args
            writes = (mode is not None and any(c in str(mode) for c in "wax+")) or bool((flags or 0) & _WRITE_FLAGS)
            if writes and path is not None and not inside(path):
                raise PermissionError(f"sandbox: writing {path!r} outside the sandbox directory is not allowed")
        elif event in _PATH_EVENTS:
            for path in args[:2]:
                if isinstance(path, (str, bytes, os.PathLike)) and not inside(path):
                    raise PermissionError(f"sandbox: {event} on {path!r} outside the sandbox directory is not allowed")

    sys.addaudithook(hook)


def main() -> None:
    limits, code_path, parent = json.loads(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    die_with_parent(parent)
    if isolate():
        # the first child is the namespace's init (every process left in it dies with it); the code
        # runs in the init's child, where signals (CPU limit, faults) act as on any process
        for _ in range(2):
            me = os.getpid()
            pid = os.fork()
            if pid:
                _, status = os.waitpid(pid, 0)
                code = os.waitstatus_to_exitcode(status)
                os._exit(code if code >= 0 else 128 - code)
            die_with_parent(0 if os.getppid() == 0 else me)  # the namespace's init sees its parent as pid 0
    sys.modules.pop("ctypes", None)
    limit(limits)
    import runpy

    source = os.path.abspath(code_path)
    guard(os.getcwd())
    sys.argv = [source]
    runpy.run_path(source, run_name="__main__")


if __name__ == "__main__":
    main()
