"""The sandbox's container: bubblewrap (``bwrap``, Debian's ``bubblewrap``, the sandbox Flatpak
uses), which :func:`alignment.sandbox.runner.run_python` puts around every run wherever it starts.

Inside it a run sees:

* its own PID, network, IPC, UTS and cgroup namespaces: no network but its own loopback,
  no other process of the machine, and everything it starts dies with it;
* a read-only system (``/usr``, the interpreter's prefix and the linker's cache only: no other ``/etc``, no ``/home``,
  no checkout, no run directory), a fresh ``/proc`` and a minimal ``/dev``;
* two private, size-limited tmpfs: its directory ``/sandbox`` (the program is ``/sandbox/main.py``)
  and ``/tmp``, ``SandboxLimits.disk_mb`` each, so a disk fill stops there;
* an unprivileged uid (65534, ``nobody``), so ``RLIMIT_NPROC`` binds even when the job runs as root:
  as root, bwrap keeps only ``CAP_SETUID`` / ``CAP_SETGID`` for :mod:`alignment.sandbox.child` to
  drop to that uid before anything else (and ``no_new_privs``); as another user, bwrap makes a user
  namespace with that uid and forbids further ones.

Where bwrap is missing or the kernel refuses it (no user namespaces for a non-root user, a
container without ``CAP_SYS_ADMIN``), :func:`probe` says why and the runner falls back to its own
namespaces with a logged warning.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from functools import lru_cache
from pathlib import Path

__all__ = ["SANDBOX_DIR", "CHILD_PATH", "NOBODY", "interpreter", "command", "probe"]

SANDBOX_DIR = "/sandbox"  # the run's directory inside the container
CHILD_PATH = "/run/megalign/child.py"
NOBODY = 65534


def interpreter() -> tuple[str, list[str]]:
    """The Python binary to run inside (``sys.executable`` resolved out of any venv) and the host
    directories it needs, read-only: its installation prefix (the standard library), where that is not
    under ``/usr`` already."""
    python = os.path.realpath(sys.executable)
    prefixes = {os.path.realpath(sys.base_prefix), os.path.dirname(os.path.dirname(python))}
    return python, sorted(p for p in prefixes if p != "/usr" and not p.startswith("/usr/"))


def command(child: Path, code_fd: int, child_args: list[str], disk_mb: int, env: dict[str, str]) -> list[str]:
    """The bwrap command line running ``python -I -S child.py CHILD_ARGS...`` in the container
    (module docstring) with only the variables ``env``, the program read from the open descriptor
    ``code_fd`` (pass it to the process: ``pass_fds``) into ``/sandbox/main.py``; ``disk_mb``: MiB of
    each tmpfs.

    Raises:
        FileNotFoundError: no ``bwrap`` on ``PATH``.
    """
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        raise FileNotFoundError("bwrap is not installed (Debian / Ubuntu: apt-get install bubblewrap)")
    python, prefixes = interpreter()
    size = str(disk_mb << 20)
    argv = [bwrap, "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try",
            "--die-with-parent", "--new-session", "--hostname", "sandbox",
            "--ro-bind", "/usr", "/usr"]
    for name in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):  # merged /usr: symlinks; else read-only
        if os.path.islink(f"/{name}"):
            argv += ["--symlink", os.readlink(f"/{name}"), f"/{name}"]
        elif os.path.isdir(f"/{name}"):
            argv += ["--ro-bind", f"/{name}", f"/{name}"]
    if os.path.exists("/etc/ld.so.cache"):  # the dynamic linker's index, and nothing else of /etc
        argv += ["--perms", "0755", "--dir", "/etc", "--ro-bind", "/etc/ld.so.cache", "/etc/ld.so.cache"]
    for prefix in prefixes:  # its parents made traversable (bwrap would copy /root's 0700)
        parents = [p for p in Path(prefix).parents if str(p) != "/"][::-1]
        for parent in parents:
            argv += ["--perms", "0755", "--dir", str(parent)]
        argv += ["--ro-bind", prefix, prefix]
    argv += ["--proc", "/proc", "--dev", "/dev",
             "--perms", "1777", "--size", size, "--tmpfs", "/tmp",
             "--perms", "0777", "--size", size, "--tmpfs", SANDBOX_DIR,
             "--perms", "0644", "--file", str(code_fd), f"{SANDBOX_DIR}/main.py",
             "--ro-bind", str(child), CHILD_PATH, "--chdir", SANDBOX_DIR, "--clearenv"]
    for key, value in env.items():
        argv += ["--setenv", key, value]
    if os.geteuid() == 0:  # the child drops to NOBODY itself: a kernel uid that RLIMIT_NPROC binds
        argv += ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
    else:
        argv += ["--unshare-user", "--uid", str(NOBODY), "--gid", str(NOBODY), "--disable-userns"]
    return argv + ["--", python, "-I", "-S", CHILD_PATH, *child_args]


@lru_cache(maxsize=1)
def probe() -> str | None:
    """Why bwrap cannot run the sandbox here, in one line (None: it can). Runs one trivial
    container, with the flags of :func:`command`, once per process."""
    if shutil.which("bwrap") is None:
        return "bwrap is not installed (Debian / Ubuntu: apt-get install bubblewrap)"
    code = os.memfd_create("megalign_probe")
    try:
        argv = command(Path(__file__), code, [], 1, {})
        argv = argv[:argv.index("--") + 1] + [interpreter()[0], "-I", "-S", "-c", "pass"]
        proc = subprocess.run(argv, pass_fds=(code,), capture_output=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as e:
        return f"bwrap did not start: {e}"
    finally:
        os.close(code)
    if proc.returncode != 0:
        return f"bwrap exited with status {proc.returncode}: {proc.stderr.decode(errors='replace').strip()[-300:]}"
    return None
