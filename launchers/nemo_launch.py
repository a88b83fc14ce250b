"""Launch a job through NVIDIA nemo-run: ``launchers/train.py --config-name NAME [overrides]``
as a ``run.Script`` on a ``run.LocalExecutor`` (torchrun, ``--nproc`` processes) or a
``run.SlurmExecutor`` (``--nodes`` x ``--gpus-per-node`` srun tasks, one per GPU), submitted
from this machine (``run.LocalTunnel``, e.g. on a login node) or over SSH (``--ssh-host``).

    python launchers/nemo_launch.py --config-name sft --nproc 2 trainer.steps=10
    python launchers/nemo_launch.py --config-name grpo --executor slurm --account ACCT --partition batch \\
        --nodes 2 --gpus-per-node 8 --time 04:00:00 parallel.tensor_model_parallel_size=2
    python launchers/nemo_launch.py --config-name grpo --executor slurm cluster=slurm_h100x8 cluster.account=ACCT
    ... --dryrun   # print the generated sbatch script, submit nothing

Nodes, GPUs per node, account, partition, time and the preemption signal default to the
config's ``cluster`` group (``configs/cluster/``); the options override them. The config is checked for the world size first (:mod:`launchers.preflight`), and a relative
``output_dir`` is made absolute (nemo-run runs the job in its own experiment directory), so a
resubmitted or requeued job finds its checkpoints and resumes. On Slurm the tasks get SIGUSR1
``--signal-seconds`` before the time limit: they checkpoint and exit 75
(:mod:`launchers.preemption`); ``--retries N`` lets nemo-run requeue the job up to N times.
Needs ``pip install -e ".[launch]"`` (nemo-run; the launch extra in pyproject.toml gives the install order).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from launchers.preflight import check, compose

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# Rendezvous for srun tasks (ranks come from SLURM_PROCID, parallel/state.py): the first
# node's address from Slurm itself (its name may not resolve everywhere), a per-job port.
SLURM_SETUP = """\
head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
export MASTER_ADDR=$(scontrol show node "$head" -o | tr ' ' '\\n' | sed -n 's/^NodeAddr=//p')
export MASTER_PORT=${MASTER_PORT:-$((20000 + SLURM_JOB_ID % 20000))}
export LOCAL_WORLD_SIZE=${LOCAL_WORLD_SIZE:-$SLURM_NTASKS_PER_NODE}"""


def train_script(config_name: str, overrides: list[str], python: str = "python"):
    """``run.Script`` running ``launchers/train.py --config-name config_name *overrides`` with ``python``."""
    import nemo_run as run

    return run.Script(path=str(ROOT / "launchers" / "train.py"), args=["--config-name", config_name, *overrides],
                      entrypoint=python)


def local_executor(nproc: int, env: dict[str, str] | None = None):
    """``run.LocalExecutor`` with ``nproc`` processes (torchrun when ``nproc`` > 1). Its processes
    run ``python`` from PATH: activate the venv first."""
    import nemo_run as run

    if nproc < 1:
        raise ValueError(f"--nproc {nproc}: must be >= 1")
    return run.LocalExecutor(ntasks_per_node=nproc, launcher="torchrun" if nproc > 1 else None,
                             env_vars=dict(env or {}))


def slurm_executor(*, account: str, partition: str | None, nodes: int, gpus_per_node: int, time: str,
                   tunnel=None, signal_seconds: int = 300, retries: int = 0, env: dict[str, str] | None = None,
                   extra: dict | None = None):
    """``run.SlurmExecutor``: ``nodes`` x ``gpus_per_node`` srun tasks, one per GPU (``gpus_per_node=0``:
    CPU nodes, one task per node), ``time`` as ``HH:MM:SS``, SIGUSR1 to the tasks ``signal_seconds``
    before the limit, requeued up to ``retries`` times after a non-zero exit. ``tunnel`` defaults to
    ``run.LocalTunnel`` under ``$NEMORUN_HOME/experiments`` (nemo-run needs exactly that dir).

    Raises:
        ValueError: ``nodes`` < 1 or ``gpus_per_node`` < 0, naming the option.
    """
    import nemo_run as run
    from nemo_run.config import get_nemorun_home

    if nodes < 1:
        raise ValueError(f"--nodes {nodes}: must be >= 1")
    if gpus_per_node < 0:
        raise ValueError(f"--gpus-per-node {gpus_per_node}: must be >= 0 (0: CPU nodes, one task each)")
    if tunnel is None:  # $NEMORUN_HOME as nemo-run read it at import
        tunnel = run.LocalTunnel(job_dir=str(Path(get_nemorun_home()) / "experiments"))
    return run.SlurmExecutor(
        account=account, partition=partition, nodes=nodes, ntasks_per_node=max(gpus_per_node, 1),
        gpus_per_node=gpus_per_node or None, time=time, tunnel=tunnel, packager=run.Packager(),
        job_name_prefix="megalign-", signal=f"USR1@{signal_seconds}" if signal_seconds else None,
        retries=retries, env_vars=dict(env or {}), setup_lines=SLURM_SETUP, additional_parameters=extra or None)


def absolute_output_dir(config_name: str, overrides: list[str], world_size: int) -> list[str]:
    """Check the config for ``world_size`` (:func:`launchers.preflight.check`, model checks only
    when ``model.path`` is an HF directory) and return ``overrides`` with an absolute ``output_dir``
    (a relative one is taken from the repository root)."""

    cfg = check(config_name, overrides, world_size, resolve_model=False)
    out = Path(cfg.output_dir)
    if out.is_absolute():
        return list(overrides)
    return [o for o in overrides if not o.startswith("output_dir=")] + [f"output_dir={ROOT / out}"]


def launch(script, executor, title: str, task: str, *, detach: bool = False, dryrun: bool = False,
           tail_logs: bool = True) -> dict:
    """Run ``script`` on ``executor`` as the one task ``task`` of a ``run.Experiment`` titled ``title``;
    returns ``{"dir", "status", "job_id"}``: the experiment directory
    (``$NEMORUN_HOME/experiments/<title>/<id>``: job scripts and logs), nemo-run's task status
    (``SUCCEEDED``, ``FAILED``, ``SUBMITTED``...; ``UNKNOWN`` for some executors) and the scheduler's job id.
    ``dryrun`` writes the job files (e.g. ``<task>_sbatch.sh``) without submitting; ``detach`` returns
    once the job is submitted (needed on a Slurm without accounting: waiting polls ``sacct``)."""
    import time

    import nemo_run as run
    from nemo_run.config import get_nemorun_home

    exp_id = f"{title}_{time.time_ns()}"
    with run.Experiment(title, executor=executor, id=exp_id, log_level="WARN") as exp:
        exp.add(script, name=task)
        if dryrun:
            exp.dryrun(log=True, delete_exp_dir=False)
            info = {"status": "DRYRUN", "job_id": ""}
        else:
            exp.run(detach=detach, tail_logs=tail_logs)
            info = exp.status(return_dict=True)[task]
    return {"dir": Path(get_nemorun_home()) / "experiments" / title / exp_id, "status": str(info["status"]),
            "job_id": info["job_id"]}


def main(argv: list[str] | None = None) -> int:
    """Command line (see the module docstring); returns the exit code: 0 when the job ran or was
    submitted, 1 when nemo-run reports it FAILED or CANCELLED, 2 for a config error."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config-name", required=True, help="a config in configs/ (grpo, sft, rm, dpo, ppo, ...)")
    ap.add_argument("--executor", choices=("local", "slurm"), default="local")
    ap.add_argument("--nproc", type=int, default=1, help="local: processes (torchrun when > 1)")
    ap.add_argument("--nodes", type=int, default=None, help="slurm: nodes (default: cluster.nodes)")
    ap.add_argument("--gpus-per-node", type=int, default=None,
                    help="slurm: GPUs = tasks per node, 0 for CPU nodes (default: cluster.gpus_per_node)")
    ap.add_argument("--account", default=None, help="slurm: account (default: cluster.account)")
    ap.add_argument("--partition", default=None, help="slurm: partition (default: cluster.partition)")
    ap.add_argument("--time", default=None, help="slurm: time limit HH:MM:SS (default: cluster.time)")
    ap.add_argument("--signal-seconds", type=int, default=None,
                    help="slurm: SIGUSR1 this long before the limit (default: cluster.preempt_signal_seconds)")
    ap.add_argument("--retries", type=int, default=0, help="slurm: requeue up to N times after a non-zero exit")
    ap.add_argument("--ssh-host", default=None, help="slurm: submit over SSH to this login node (else locally)")
    ap.add_argument("--ssh-user", default=os.environ.get("USER", ""), help="slurm: SSH user")
    ap.add_argument("--remote-job-dir", default=None, help="slurm over SSH: experiment dir on the cluster")
    ap.add_argument("--python", default="python", help="python on the nodes (default: from PATH)")
    ap.add_argument("--name", default=None, help="experiment name (default: megalign-<config>)")
    ap.add_argument("--dryrun", action="store_true", help="write and print the job script, submit nothing")
    ap.add_argument("--detach", action="store_true", help="return once submitted")
    ap.add_argument("overrides", nargs="*", help="hydra overrides, key=value (cluster=<name> picks configs/cluster/)")
    a = ap.parse_args(argv)
    import nemo_run as run

    try:
        c = compose(a.config_name, a.overrides).cluster
        nodes = a.nodes if a.nodes is not None else c.nodes
        gpus = a.gpus_per_node if a.gpus_per_node is not None else c.gpus_per_node
        world = a.nproc if a.executor == "local" else nodes * max(gpus, 1)
        overrides = absolute_output_dir(a.config_name, a.overrides, world)
    except Exception as e:  # noqa: BLE001 - every config error is reported the same way
        print(f"nemo_launch: config error for --config-name {a.config_name}: {type(e).__name__}: {e}", flush=True)
        return 2
    if a.executor == "local":
        executor = local_executor(a.nproc)
    else:
        tunnel = None
        if a.ssh_host:
            if not a.remote_job_dir:
                raise SystemExit("--ssh-host needs --remote-job-dir (the experiment dir on the cluster)")
            tunnel = run.SSHTunnel(host=a.ssh_host, user=a.ssh_user, job_dir=a.remote_job_dir)
        executor = slurm_executor(
            account=a.account if a.account is not None else c.account,
            partition=(a.partition if a.partition is not None else c.partition) or None, nodes=nodes,
            gpus_per_node=gpus, time=a.time or c.time, tunnel=tunnel,
            signal_seconds=a.signal_seconds if a.signal_seconds is not None else c.preempt_signal_seconds,
            retries=a.retries)
    r = launch(train_script(a.config_name, overrides, a.python), executor, a.name or f"megalign-{a.config_name}",
               a.config_name, detach=a.detach, dryrun=a.dryrun)
    print(f"nemo-run: {r['status']} job {r['job_id']}, experiment dir {r['dir']}", flush=True)
    return 1 if r["status"] in ("FAILED", "CANCELLED") else 0


if __name__ == "__main__":
    sys.exit(main())
