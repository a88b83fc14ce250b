"""Ending a job's processes in order, whichever way the job ends (finished, preempted, a checkpoint
rewritten): rank 0 says why and closes the TensorBoard writer and the trackers, every rank waits for the others, then
the judges this process runs and the rollout engine are closed (vLLM's teardown also tears down
torch.distributed) and the process groups shut down."""

from __future__ import annotations

import torch.distributed as dist

from alignment.rewards.judge_models import close_local
from parallel.state import shutdown


def close_job(job, message: str, engine=None) -> None:
    """Close ``job`` (a :class:`launchers.common.Run`): rank 0 prints ``message`` and closes the TensorBoard
    writer and the trackers (``close_loggers``); a barrier; then the local judges, ``engine`` (None: no
    rollout engine) and the process groups. Collective."""
    if job.rank == 0:
        print(message, flush=True)
        job.close_loggers()
    dist.barrier()
    close_local()  # the judges run in this process (reward.functions: judge with a model directory)
    if engine is not None:
        engine.close()
    shutdown()
