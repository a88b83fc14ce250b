"""A job's hold on its processes and run directory (launchers/job_guard.py): one live job per run
directory (a second refused, naming the holder; a dead holder's lock never blocks), and ranks
started by torchrun that die with their launcher; the sandbox's processes die with the process
that started them. Real processes, SIGKILLed. And what a failed job says (launchers/phase_log.py):
the rank, its pid and host, and the phase it was in, from records written by hand (a real launch:
tests/test_rank_failure.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from alignment.schema import ConfigError
from launchers.job_guard import check_run_dir_free, lock_run_dir

ROOT = Path(__file__).resolve().parents[1]


def _python(code: str, env: dict | None = None) -> subprocess.Popen:
    """A child Python running ``code`` (from the repository root), its stdout piped."""
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, stdout=subprocess.PIPE,
                            text=True, env={**os.environ, **(env or {})})


def _gone(pid: int, within: float) -> bool:
    """Whether process ``pid`` has ended (or is a zombie) within ``within`` seconds."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.05)
    return False


def _holder(out: Path, rank: int = 0) -> subprocess.Popen:
    """A process that takes ``out``'s lock for ``rank``, says "held", then sleeps."""
    proc = _python(f"""
        import time
        from launchers.job_guard import lock_run_dir
        lock_run_dir({str(out)!r}, {rank})
        print("held", flush=True)
        time.sleep(120)
    """)
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_a_second_job_on_a_run_directory_is_refused_and_a_dead_ones_lock_never_blocks(tmp_path):
    out = tmp_path / "run"
    holder = _holder(out)
    try:
        with pytest.raises(ConfigError) as info:
            check_run_dir_free(out)  # megalign train's check, before it launches
        message = str(info.value)
        assert f"output_dir={out} is in use by a job that is still running (rank 0 is pid {holder.pid} on host " \
               f"{os.uname().nodename}, started 20" in message and f"kill {holder.pid}" in message, message
        with pytest.raises(ConfigError, match=f"rank 0 is pid {holder.pid}"):
            lock_run_dir(out, 0)  # the rank's own lock at start
        lock_run_dir(out, 1)  # another rank's file is free (the holder's job has one rank)
        assert sorted(p.name for p in (out / ".megalign_lock").iterdir()) == ["rank0", "rank1"]
    finally:
        holder.kill()
        holder.wait()
    # the holder died by SIGKILL: its file is still there, its lock went with it
    assert (out / ".megalign_lock" / "rank0").read_text().startswith('{"rank": 0')
    check_run_dir_free(out)  # rank0: its holder is dead; rank1: held by this process, its own
    lock_run_dir(out, 0)
    assert f'"pid": {os.getpid()}' in (out / ".megalign_lock" / "rank0").read_text()
    lock_run_dir(out, 0)  # a resume in the same process keeps its lock

    other = tmp_path / "other"
    lock_run_dir(other, 0)  # a next job in this process: the first directory is free again
    proc = _python(f"""
        from launchers.job_guard import check_run_dir_free, lock_run_dir
        check_run_dir_free({str(out)!r}); lock_run_dir({str(out)!r}, 0); print("took it", flush=True)
    """)
    assert proc.communicate(timeout=60)[0].strip() == "took it"
    refused = _python(f"""
        from alignment.schema import ConfigError
        from launchers.job_guard import lock_run_dir
        try:
            lock_run_dir({str(other)!r}, 0)
        except ConfigError as e:
            print(e, flush=True)
    """)  # negative control: a live holder (this process, on its new directory) does block
    assert f"rank 0 is pid {os.getpid()}" in refused.communicate(timeout=60)[0]


def test_ranks_started_by_torchrun_die_with_their_launcher_and_others_do_not(tmp_path):
    """A "launcher" process starts a "rank" that asks to die with it (``TORCHELASTIC_RUN_ID`` set, as
    torchrun sets it) and one that is not under torchrun; the launcher is SIGKILLed alone."""
    launcher = _python("""
        import os, subprocess, sys, time
        rank = "from launchers.job_guard import die_with_launcher; import time; print(die_with_launcher(), flush=True); time.sleep(120)"
        under = subprocess.Popen([sys.executable, "-c", rank], env={**os.environ, "TORCHELASTIC_RUN_ID": "test"},
                                 stdout=subprocess.PIPE, text=True, start_new_session=True)
        plain = subprocess.Popen([sys.executable, "-c", rank], env={k: v for k, v in os.environ.items()
                                                                   if k != "TORCHELASTIC_RUN_ID"},
                                 stdout=subprocess.PIPE, text=True, start_new_session=True)
        said = under.stdout.readline().strip(), plain.stdout.readline().strip()
        print(under.pid, plain.pid, *said, flush=True)
        time.sleep(120)
    """)
    under, plain, said_under, said_plain = launcher.stdout.readline().split()
    assert (said_under, said_plain) == ("True", "False")
    os.kill(launcher.pid, signal.SIGKILL)  # the launcher alone: the ranks are in sessions of their own
    launcher.wait()
    try:
        assert _gone(int(under), within=5), "a rank under torchrun outlived its launcher"
        assert not _gone(int(plain), within=1)  # a plain run outlives its shell (nohup), as before
    finally:
        for pid in (int(under), int(plain)):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_a_sandbox_dies_with_the_process_that_started_it(tmp_path):
    """A rank runs a sandboxed program that would sleep past any wall clock; the rank is SIGKILLed
    (its thread never kills the sandbox): no process of the sandbox is left within seconds."""
    marker = f"megalign_orphan_{os.getpid()}"
    rank = _python(f"""
        import time
        from alignment.sandbox.runner import SandboxLimits, SandboxPool
        pool = SandboxPool(1, SandboxLimits(wall_seconds=600, cpu_seconds=600))
        pool.submit("import time; {marker} = 1; time.sleep(600)")
        print("running", flush=True)
        time.sleep(600)
    """)
    assert rank.stdout.readline().strip() == "running"

    def sandbox() -> list[psutil.Process]:  # the run's launcher (bwrap or child.py, given the limits), not a probe
        found = []
        for p in psutil.process_iter(["cmdline", "ppid"]):
            if p.info["ppid"] == rank.pid and any("wall_seconds" in a for a in p.info["cmdline"] or []):
                found.append(p)
        return found

    deadline = time.monotonic() + 30
    while not (started := sandbox()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert started, "the sandbox did not start"
    family = [p.pid for p in started] + [c.pid for p in started for c in p.children(recursive=True)]
    os.kill(rank.pid, signal.SIGKILL)
    rank.wait()
    assert all(_gone(pid, within=5) for pid in family), f"sandbox processes outlived their rank: {family}"


@pytest.mark.slow
def test_a_real_job_holds_its_directory_and_dies_with_its_launcher(tmp_path, capfd):
    """``megalign train`` (the launcher: torchrun's agent in that process) runs a 2-rank SFT job;
    while it trains, a second launch on its directory is refused naming rank 0's pid; the launcher
    alone is SIGKILLed: both ranks end within seconds, and the directory is free again."""
    from tests.dist.tiny_llama import save_tiny_hf_dir
    from tools import cli

    model, out = save_tiny_hf_dir(tmp_path / "tiny"), tmp_path / "out"
    args = ["--config-name=sft", f"model.path={model}", f"output_dir={out}", "trainer.epochs=1000",
            "trainer.eval_before=false", "trainer.save_checkpoint=false", "trainer.export_hf=false",
            "trainer.progress_bar=false"]
    launcher = subprocess.Popen([sys.executable, "-m", "tools.cli", "train", "--nproc", "2", *args], cwd=ROOT,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        pids, deadline = {}, time.monotonic() + 180
        while len(pids) < 2 and time.monotonic() < deadline and launcher.poll() is None:
            for r in (0, 1):
                try:
                    pids[r] = int(json.loads((out / ".megalign_lock" / f"rank{r}").read_text())["pid"])
                except (OSError, ValueError, KeyError):
                    pass
            time.sleep(0.2)
        assert len(pids) == 2, f"the job did not start (launcher status {launcher.poll()})"
        assert all(psutil.Process(p).ppid() == launcher.pid for p in pids.values())
        capfd.readouterr()
        assert cli.train(["--dry-run", "--nproc", "2", *args]) == 2
        assert f"is in use by a job that is still running (rank 0 is pid {pids[0]} on host" in capfd.readouterr().err
        os.kill(launcher.pid, signal.SIGKILL)  # the launcher alone, as `kill -9 <megalign>` does
        launcher.wait()
        assert all(_gone(p, within=10) for p in pids.values()), "ranks outlived their launcher"
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert cli.train(["--dry-run", "--nproc", "2", *args]) == 0  # a dead job's locks never block


def _phase(out: Path, rank: int, phase: str, step: int, error: str | None = None) -> int:
    """Write rank ``rank``'s record as launchers.phase_log does; returns its pid (made up)."""
    (out / "logs").mkdir(parents=True, exist_ok=True)
    pid = 1000 + rank
    (out / "logs" / f"rank{rank}.phase").write_text(json.dumps(
        {"rank": rank, "pid": pid, "host": "node7", "phase": phase, "step": step, "since": 0.0, "error": error}))
    return pid


def test_failure_report_names_the_rank_and_its_phase(tmp_path):
    from launchers import phase_log

    # a rank killed by a signal: named with its phase; the others failed in their next collective
    _phase(tmp_path, 0, "training", 3, "RuntimeError: [gloo] Connection closed by peer [127.0.0.1]:1234")
    _phase(tmp_path, 1, "rollout", 3)
    assert phase_log.failure_report({0: (1000, 1), 1: (1001, -9)}, tmp_path, 20) == \
        "rank 1 (pid 1001 on node7) was killed by SIGKILL during the rollout of step 3; the other ranks were stopped"
    # a collective timed out: the rank that recorded no error stopped answering
    _phase(tmp_path, 0, "weight sync", 4, "RuntimeError: [gloo] Timed out waiting 20000ms for recv operation")
    _phase(tmp_path, 1, "training", 4)
    assert phase_log.failure_report({0: (1000, 1), 1: (1001, -9)}, tmp_path, 20) == (
        "rank 1 (pid 1001 on node7) during the training of step 4 stopped answering: rank 0 (pid 1000 on node7) "
        "waited trainer.collective_timeout_s=20 s in a collective during the weight sync of step 4 and gave up "
        "(RuntimeError: [gloo] Timed out waiting 20000ms for recv operation)")
    # an error of the program: the rank and its error
    _phase(tmp_path, 1, "checkpoint", 2, "OSError: [Errno 5] Input/output error")
    _phase(tmp_path, 0, "start-up", 0, "ValueError: boom")
    assert phase_log.failure_report({0: (1000, 1), 1: (1001, 1)}, tmp_path) == \
        "rank 0 (pid 1000 on node7) failed during the start-up: ValueError: boom"
    (tmp_path / "logs" / "rank0.phase").unlink()  # a rank that died before it recorded anything
    assert phase_log.failure_report({0: (1000, -9), 1: (1001, 1)}, tmp_path) == \
        "rank 0 (pid 1000) was killed by SIGKILL before it recorded a phase; the other ranks were stopped"


def test_phases_are_recorded_as_a_rank_goes(tmp_path):
    from launchers import phase_log

    phase_log.open_log(tmp_path, 3)
    assert phase_log.read_phases(tmp_path)[3]["phase"] == "start-up"
    phase_log.record("training", 5)
    phase_log.record_error(RuntimeError("first line\nsecond line"))
    rec = phase_log.read_phases(tmp_path)[3]
    assert (rec["phase"], rec["step"], rec["error"], rec["pid"]) == ("training", 5, "RuntimeError: first line",
                                                                       os.getpid())
