"""torchrun worker: several real jobs (launchers/train.py's ``run``) in turn, in one launch.

    torchrun --nproc-per-node 2 tests/dist/jobs_worker.py JOBS.json

``JOBS.json`` is a list of jobs, each ``{"config", "model", "out", "overrides", "result", "reward",
"env"}``: the config name in ``configs/`` (composed with ``model.path``, ``output_dir``, fp32 and
the overrides), the reward patch of :func:`tests.dist.e2e_worker.reward_patch` (``task`` keeps
the task's grader), and environment variables set for the job alone. Rank 0 writes each job's
summary to its ``result``. What a launch costs before the first job (interpreters, imports:
~10-15 s on 2 cores) is paid once; each job still builds its models, reads its data and
checkpoints as its own run does (tests/conftest.py's ``run_jobs``).

Each job gets a default process group of its own, over a store prefix of its own
(``job<i>``): megalign's ``shutdown`` leaves a default group it did not start, and vLLM's engine
teardown ends it, so a group per job keeps every job's start the same. Disaggregated jobs start
split worlds of their own: run them alone (``e2e_worker.py``).
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from tests.dist.e2e_worker import reward_patch, run_job
from tests.dist.report import exit_now


def default_group(index: int) -> None:
    """A default process group over torchrun's store, under the prefix ``job<index>``."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                          timeout=datetime.timedelta(minutes=30))
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group(backend, store=dist.PrefixStore(f"job{index}", store), rank=rank, world_size=world)


@contextlib.contextmanager
def environment(values: dict):
    """``os.environ`` with ``values`` set, put back afterwards."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update({k: str(v) for k, v in values.items()})
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def main() -> None:
    [jobs_file] = sys.argv[1:]
    for i, job in enumerate(json.loads(Path(jobs_file).read_text())):
        if dist.is_initialized():  # the previous job ended without vLLM (which ends it)
            dist.destroy_process_group()
        default_group(i)
        with environment(job.get("env", {})), reward_patch(job.get("reward", "task")):
            run_job(job["model"], job["out"], job["overrides"], job["result"], config=job["config"])


if __name__ == "__main__":
    main()
    exit_now()
