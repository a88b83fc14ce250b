"""A real Slurm cluster on this host for tests: munge, one slurmctld and two slurmd ("nodes"
n1 and n2, both 127.0.0.1 on their own ports), configured in a temp dir (no systemd, no
accounting). Each node advertises 2 fake GPUs (``Gres=gpu:2`` over two empty files; no GPU is
opened) so job scripts can ask for ``--gpus-per-node`` as on a GPU cluster.

Measured here (Debian 12, slurm-wlm 22.05.8): bring-up 1.3 s. See
``shared/notes/platform-facts.md`` ("Slurm") for why each setting is there.
"""

from __future__ import annotations

import os
import random
import re
import shutil
import socket
import subprocess
import time
from pathlib import Path

NODES = ("n1", "n2")


def slurm_installed() -> bool:
    """True when slurmctld, slurmd, sbatch and munged are on this machine."""
    return all(shutil.which(b) or Path(f"/usr/sbin/{b}").exists() for b in ("slurmctld", "slurmd", "munged")) \
        and shutil.which("sbatch") is not None


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _node_hardware() -> str:
    """CPUs/Boards/Sockets/Cores/Threads/RealMemory as ``slurmd -C`` reports them (more than the
    hardware would mark the node INVAL and jobs would pend forever)."""
    out = subprocess.run(["slurmd", "-C"], capture_output=True, text=True, check=True).stdout
    first = out.splitlines()[0]
    return " ".join(f for f in first.split() if not f.startswith("NodeName="))


class SlurmCluster:
    """Start with :meth:`start`, stop with :meth:`stop`; :attr:`env` is the environment client
    commands (sbatch, squeue, scontrol) need: ``SLURM_CONF`` pointing at this cluster."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self.conf = self.root / "slurm.conf"
        self.procs: list[subprocess.Popen] = []
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}

    def write_conf(self) -> None:
        ctl_port, n1_port, n2_port = _free_ports(3)
        r = self.root
        for d in ("state", "spool/n1", "spool/n2", "log"):
            (r / d).mkdir(parents=True, exist_ok=True)
        hw = _node_hardware()
        self.conf.write_text("\n".join([
            "ClusterName=megalign-test",
            f"FirstJobId={random.randint(1000, 900000)}",  # job ids (log and stop file names) differ between clusters
            "SlurmctldHost=localhost(127.0.0.1)",
            f"SlurmctldPort={ctl_port}",
            "SlurmUser=root",
            "AuthType=auth/munge",
            "AuthInfo=cred_expire=5",  # else a requeued job waits 121 s before it may start again
            "ProctrackType=proctrack/linuxproc",  # the cgroup default fails here ("freezer not mounted")
            "TaskPlugin=task/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "GresTypes=gpu",
            "SchedulerParameters=sched_interval=2,bf_interval=1",
            "MailProg=/bin/true",
            "ReturnToService=2",
            "MinJobAge=600",  # finished jobs stay visible to scontrol for 10 min (no accounting)
            "AccountingStorageType=accounting_storage/none",
            "JobCompType=jobcomp/none",
            f"StateSaveLocation={r}/state",
            f"SlurmdSpoolDir={r}/spool/%n",
            f"SlurmctldPidFile={r}/slurmctld.pid",
            f"SlurmdPidFile={r}/slurmd.%n.pid",
            f"SlurmctldLogFile={r}/log/slurmctld.log",
            f"SlurmdLogFile={r}/log/slurmd.%n.log",
            f"NodeName=n1 NodeHostname=localhost NodeAddr=127.0.0.1 Port={n1_port} Gres=gpu:2 {hw}",
            f"NodeName=n2 NodeHostname=localhost NodeAddr=127.0.0.1 Port={n2_port} Gres=gpu:2 {hw}",
            "PartitionName=debug Nodes=n[1-2] Default=YES MaxTime=INFINITE State=UP",
            "",
        ]))
        for i in range(2):  # gres/gpu needs device files; plain files do (no GPU is ever opened)
            (r / f"gpu{i}").touch()
        (r / "gres.conf").write_text(f"NodeName=n[1-2] Name=gpu File={r}/gpu[0-1]\n")

    def _start_munge(self) -> None:
        probe = subprocess.run(["munge", "-n"], capture_output=True)
        if probe.returncode == 0:
            return  # a munged is already running (ours from an earlier session, or the system's)
        run = Path("/run/munge")
        run.mkdir(parents=True, exist_ok=True)
        shutil.chown(run, "munge", "munge")
        if not Path("/etc/munge/munge.key").exists():
            subprocess.run(["runuser", "-u", "munge", "--", "mungekey", "--create"], check=True)
        subprocess.run(["runuser", "-u", "munge", "--", "/usr/sbin/munged"], check=True)

    def start(self, timeout: float = 30.0) -> None:
        """Write the config, start munged (when none answers), slurmctld and both slurmd, and wait
        until both nodes are idle. Raises RuntimeError with the daemons' logs on timeout."""
        self.write_conf()
        self._start_munge()
        log = open(self.root / "log" / "daemons.out", "ab")
        self.procs.append(subprocess.Popen(["slurmctld", "-D", "-f", str(self.conf)], stdout=log, stderr=log,
                                           env=self.env))
        for n in NODES:
            self.procs.append(subprocess.Popen(["slurmd", "-D", "-f", str(self.conf), "-N", n], stdout=log,
                                               stderr=log, env=self.env))
        deadline = time.time() + timeout
        while time.time() < deadline:
            out = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %t"], capture_output=True, text=True,
                                 env=self.env).stdout
            states = dict(line.split() for line in out.splitlines() if line.strip())
            if all(states.get(n) == "idle" for n in NODES):
                return
            time.sleep(0.3)
        logs = self.logs()
        self.stop()
        raise RuntimeError(f"Slurm nodes not idle after {timeout} s: {states}\n{logs}")

    def logs(self) -> str:
        """The tail of every daemon log (for failure messages)."""
        parts = []
        for f in sorted((self.root / "log").glob("*")):
            parts.append(f"== {f.name}\n" + "\n".join(f.read_text(errors="replace").splitlines()[-30:]))
        return "\n".join(parts)

    def stop(self) -> None:
        """Cancel every job and stop slurmctld and the slurmd. munged keeps running (a host
        daemon that another cluster in a concurrent test session may be using)."""
        subprocess.run(["scancel", "--full", "-u", "root"], env=self.env, capture_output=True)
        for p in reversed(self.procs):
            p.terminate()
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()

    # -- jobs -------------------------------------------------------------------------------

    def sbatch(self, *args: str, cwd: Path, env: dict | None = None) -> int:
        """Submit ``sbatch args...`` from ``cwd``; returns the job id. Raises CalledProcessError."""
        out = subprocess.run(["sbatch", "--parsable", *args], cwd=cwd, env={**self.env, **(env or {})},
                             capture_output=True, text=True)
        if out.returncode != 0:
            raise RuntimeError(f"sbatch {' '.join(args)} failed: {out.stderr}")
        return int(out.stdout.strip().split(";")[0])

    def job(self, job_id: int) -> dict[str, str]:
        """``scontrol show job`` as a dict (JobState, ExitCode, Restarts, NodeList, ...)."""
        out = subprocess.run(["scontrol", "show", "job", "-o", str(job_id)], capture_output=True, text=True,
                             env=self.env).stdout
        return dict(m.groups() for m in re.finditer(r"(\w+)=(\S*)", out))

    def wait(self, job_id: int, timeout: float, states=("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT",
                                                          "NODE_FAIL", "OUT_OF_MEMORY")) -> dict[str, str]:
        """Poll until the job reaches one of ``states``; returns its record. Raises TimeoutError."""
        deadline = time.time() + timeout
        info = {}
        while time.time() < deadline:
            info = self.job(job_id)
            if info.get("JobState") in states:
                return info
            time.sleep(0.5)
        raise TimeoutError(f"job {job_id} still {info.get('JobState')} after {timeout} s\n{self.logs()}")
