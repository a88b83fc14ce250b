"""What each rank is doing, kept on disk so that a job that dies says where.

Every rank records its phase as the loop enters it (start-up, evaluation, rollout, training,
weight sync, checkpoint, export; :func:`record`) in ``<output_dir>/logs/rank<r>.phase`` (a few
hundred bytes, replaced atomically: one write per phase), and the error that ends it
(:func:`record_error`). When a launch fails, ``megalign train`` reads every rank's record
(:func:`read_phases`) and says which rank died or stopped answering, in which phase of which step
(:func:`failure_report`), instead of torchrun's report of exit codes.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from pathlib import Path

_PATH: list[Path] = []  # this process's record file, once opened
_STATE: dict = {}


def open_log(output_dir: str | os.PathLike, rank: int) -> None:
    """Start recording this rank's phases in ``<output_dir>/logs/rank<rank>.phase``."""
    _PATH[:] = [Path(output_dir) / "logs" / f"rank{rank}.phase"]
    _PATH[0].parent.mkdir(parents=True, exist_ok=True)
    _STATE.clear()
    _STATE.update(rank=rank, pid=os.getpid(), host=os.uname().nodename, error=None)
    record("start-up", 0)


def _write() -> None:
    if not _PATH:
        return
    tmp = _PATH[0].with_name(_PATH[0].name + ".tmp")
    tmp.write_text(json.dumps(_STATE))
    os.replace(tmp, _PATH[0])


def record(phase: str, step: int) -> None:
    """This rank enters ``phase`` of the optimizer step ``step`` (1-based; 0: before the first)."""
    _STATE.update(phase=phase, step=step, since=time.time())
    _write()


def record_error(exc: BaseException) -> None:
    """The error that ends this rank (its type and first line)."""
    text = next((line.strip() for line in str(exc).splitlines() if line.strip()), "")
    _STATE.update(error=f"{type(exc).__name__}: {text}"[:500], failed=time.time())
    _write()


def read_phases(output_dir: str | os.PathLike) -> dict[int, dict]:
    """Every rank's last record under ``output_dir`` (rank -> record; unreadable ones left out)."""
    out = {}
    for path in sorted((Path(output_dir) / "logs").glob("rank*.phase")):
        try:
            rec = json.loads(path.read_text())
            out[int(rec["rank"])] = rec
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return out


def _where(rec: dict | None) -> str:
    if rec is None:
        return "before it recorded a phase"
    return f"during the {rec['phase']}" + (f" of step {rec['step']}" if rec.get("step") else "")


def failure_report(failures: dict[int, tuple[int, int]], output_dir: str | os.PathLike,
                   timeout_s: float | None = None) -> str:
    """One line saying why a launch failed. ``failures``: global rank -> ``(pid, exit code)`` of each
    rank the launcher saw fail (a negative code: killed by that signal); ``output_dir``: where the
    ranks recorded their phases; ``timeout_s``: ``trainer.collective_timeout_s``. In order:

    - a rank's collective timed out: the ranks that recorded no error of their own stopped
      answering; each is named with where it stopped;
    - a rank was killed by a signal before it recorded an error: it is named with its phase (the
      others then fail in their next collective, or the launcher stops them);
    - else the lowest failed rank that recorded an error, with it.
    """
    phases = read_phases(output_dir)

    def who(rank: int) -> str:
        rec = phases.get(rank)
        pid = rec["pid"] if rec else failures.get(rank, ("?",))[0]
        return f"rank {rank} (pid {pid}{' on ' + rec['host'] if rec else ''})"

    errors = {r: p["error"] for r, p in phases.items() if p.get("error")}
    timed_out = [r for r, e in sorted(errors.items()) if re.search(r"timed? ?out|timeout", e, re.IGNORECASE)]
    silent = [r for r in sorted(phases) if r not in errors]
    if timed_out and silent:
        waited = f"trainer.collective_timeout_s={timeout_s:g} s" if timeout_s else "the collective timeout"
        hung = ", ".join(f"{who(r)} {_where(phases[r])}" for r in silent)
        first = timed_out[0]
        return (f"{hung} stopped answering: {who(first)} waited {waited} in a collective {_where(phases[first])} "
                f"and gave up ({errors[first]})")
    killed = [r for r, (_, code) in sorted(failures.items()) if code < 0 and r not in errors]
    if killed:
        r = killed[0]
        code = -failures[r][1]
        try:
            name = signal.Signals(code).name
        except ValueError:  # a number no signal has
            name = f"signal {code}"
        return f"{who(r)} was killed by {name} {_where(phases.get(r))}; the other ranks were stopped"
    r = min(errors) if errors else min(failures)
    return f"{who(r)} failed {_where(phases.get(r))}: {errors.get(r) or f'exit status {failures[r][1]}'}"
