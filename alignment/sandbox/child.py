"""The sandbox's launcher, run as ``python -I -S child.py OPTIONS_JSON CODE_PATH PARENT_PID`` in the
sandbox's directory by :func:`alignment.sandbox.runner.run_python` (standard library only: it is
run without ``site``; ``OPTIONS_JSON``: the limits, ``audit_hook`` and ``container``, true inside
the bubblewrap container; ``PARENT_PID``: the process that started it, as this one sees it). In order:

0. die with the parent (``prctl(PR_SET_PDEATHSIG, SIGKILL)``, again after each fork): a sandbox
   outlives neither the rank that started it nor, level by level, its own launcher, whatever kills them;
1. in the container (its namespaces made by bwrap): as root, drop to uid and gid 65534 with no
   supplementary groups, so that ``RLIMIT_NPROC`` binds; outside it, new network and PID namespaces
   (``unshare``; a user namespace too when not root), when the kernel allows: no interface but a down
   loopback, and every process the code starts dies with it; then fork twice: the child is the
   namespace's init, the grandchild runs the code; each parent waits and exits with its child's
   status (killed by signal N: 128 + N);
2. resource limits (CPU seconds, address space, file size, open files, processes, no core dumps);
3. an audit hook (PEP 578) that refuses, with ``PermissionError``: new processes (fork, exec,
   spawn, ``subprocess``), sockets, ``ctypes`` and writes, renames, removals outside the directory
   (a tripwire with readable reasons; the container is the boundary);
4. the code, as ``__main__``.
"""

import json
import os
import resource
import signal
import sys

CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
PR_SET_PDEATHSIG = 1
NOBODY = 65534
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


def drop_root() -> None:
    """Become uid / gid NOBODY with no supplementary groups (as root in the container, which leaves
    this process ``CAP_SETUID`` and ``CAP_SETGID`` for it; after it, no capability at all)."""
    if os.geteuid() == 0:
        os.setgroups([])
        os.setresgid(NOBODY, NOBODY, NOBODY)
        os.setresuid(NOBODY, NOBODY, NOBODY)


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
    """Install the audit hook (it cannot be removed). What it calls is bound here, in its closure,
    so that the code cannot switch it off by replacing this module's globals or ``os.path.realpath``."""
    root = os.path.realpath(root)
    realpath, fsdecode, sep, path_types = os.path.realpath, os.fsdecode, os.sep, (str, bytes, os.PathLike)
    process_events, path_events, blocked = frozenset(_PROCESS_EVENTS), frozenset(_PATH_EVENTS), _BLOCKED_MODULES
    write_flags, denied, is_a, text = _WRITE_FLAGS, PermissionError, isinstance, str

    def inside(path) -> bool:  # fails closed: whatever goes wrong (a patched builtin...) refuses
        try:
            if is_a(path, int):
                return True  # an open descriptor: its file was checked when it was opened
            full = realpath(fsdecode(path))
            return full == root or full.startswith(root + sep)
        except Exception:
            return False

    def hook(event, args):
        if event in process_events or event.startswith("ctypes."):
            raise denied(f"sandbox: {event} is not allowed")
        if event == "import" and args[0].split(".")[0] in blocked:
            raise denied(f"sandbox: importing {args[0]} is not allowed")
        if event == "open":
            path, mode, flags = args
            writes = (mode is not None and any(c in text(mode) for c in "wax+")) or bool((flags or 0) & write_flags)
            if writes and path is not None and not inside(path):
                raise denied(f"sandbox: writing {path!r} outside the sandbox directory is not allowed")
        elif event in path_events:
            for path in args[:2]:
                if is_a(path, path_types) and not inside(path):
                    raise denied(f"sandbox: {event} on {path!r} outside the sandbox directory is not allowed")

    sys.addaudithook(hook)


def main() -> None:
    options, code_path, parent = json.loads(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    die_with_parent(parent)
    if options.get("container"):
        drop_root()
    elif isolate():
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
    limit(options)
    import runpy

    source = os.path.abspath(code_path)
    if options.get("audit_hook", True):
        guard(os.getcwd())
    sys.argv = [source]
    runpy.run_path(source, run_name="__main__")


if __name__ == "__main__":
    main()
