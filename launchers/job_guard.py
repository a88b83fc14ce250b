"""A job's hold on its processes and its run directory.

- **Ranks die with their launcher.** torchrun starts each rank in a session of its own, so a
  SIGKILL of the launcher (or of its process group) used to leave the ranks running as orphans,
  training and writing checkpoints. :func:`die_with_launcher` asks the kernel to SIGKILL a rank
  when its parent, torchrun's agent, dies (``prctl(PR_SET_PDEATHSIG)``); the sandbox's processes
  do the same level by level (:mod:`alignment.sandbox.child`).
- **One run directory, one job.** Every rank holds an exclusive ``flock`` on
  ``<output_dir>/.megalign_lock/rank<r>`` for as long as its process lives, with its host, pid and
  start time written in the file (:func:`lock_run_dir`). A second job on the directory is refused
  before it writes anything, naming the holder; the kernel drops a dead process's lock, so a lock
  file left behind never blocks. ``megalign train`` checks the directory before it launches
  (:func:`check_run_dir_free`).
"""

from __future__ import annotations

import fcntl
import json
import os
import time
from pathlib import Path

from alignment.schema import ConfigError
from parallel.process_life import die_with_parent

LOCK_DIR = ".megalign_lock"

_held: dict[str, int] = {}  # this process's run-directory lock: lock file -> its descriptor


def die_with_launcher() -> bool:
    """Under torchrun (``TORCHELASTIC_RUN_ID`` set), have the kernel SIGKILL this process when its
    parent, the launcher's agent, dies (:func:`parallel.process_life.die_with_parent`). Elsewhere (a
    plain ``python`` run, srun) nothing changes: a shell's exit must not end a ``nohup`` run.
    Returns whether it was set."""
    return "TORCHELASTIC_RUN_ID" in os.environ and die_with_parent()


def _holder(path: Path) -> str:
    try:
        who = json.loads(path.read_text())
        return (f"rank {who['rank']} is pid {who['pid']} on host {who['host']}, started {who['started']}"
                f"; stop it with kill {who['pid']} there")
    except (OSError, ValueError, KeyError, TypeError):  # written a moment from now
        return f"{path.name} is held by a process that has not yet written who it is"


def _in_use(output_dir, path: Path) -> ConfigError:
    return ConfigError(f"output_dir={output_dir} is in use by a job that is still running ({_holder(path)}); wait "
                       "for it to end, stop it, or give another output_dir")


def lock_run_dir(output_dir: str | os.PathLike, rank: int) -> None:
    """Hold ``<output_dir>/.megalign_lock/rank<rank>`` exclusively for the rest of this process's
    life, recording this process (host, pid, start time) in it. A job run after another in the same
    process takes the lock over (a resume in the same directory keeps it). On a filesystem without
    locks a warning is printed and the job goes on.

    Raises:
        ConfigError: another live process holds the file, named by host, pid and start time.
    """
    folder = Path(output_dir) / LOCK_DIR
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"rank{rank}"
    key = str(path.resolve())
    if key in _held:
        return
    for other in list(_held):  # this process's last job is over: its directory is free again
        os.close(_held.pop(other))
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise _in_use(output_dir, path) from None
    except OSError as e:  # e.g. a filesystem without locks
        os.close(fd)
        print(f"warning: cannot lock {path} ({e}); nothing stops a second job from writing {output_dir}", flush=True)
        return
    started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    os.ftruncate(fd, 0)
    os.write(fd, json.dumps({"rank": rank, "pid": os.getpid(), "host": os.uname().nodename,
                             "started": started}).encode())
    _held[key] = fd


def check_run_dir_free(output_dir: str | os.PathLike) -> None:
    """No live job holds a lock in ``output_dir`` (locks this process holds aside); reads only.

    Raises:
        ConfigError: naming the holder (:func:`lock_run_dir`).
    """
    folder = Path(output_dir) / LOCK_DIR
    for path in sorted(folder.glob("rank*")) if folder.is_dir() else []:
        if str(path.resolve()) in _held:
            continue
        fd = os.open(path, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            raise _in_use(output_dir, path) from None
        except OSError:  # a filesystem without locks: nothing to learn here
            pass
        finally:
            os.close(fd)
