"""Stop a job cleanly when the cluster asks, so a requeued job loses no finished step.

SIGUSR1 or SIGTERM (or the file named by ``$MEGALIGN_STOP_FILE``, which ``slurm/launch.sh``
touches in case a signal came before a process installed its handler) sets a flag. At every
step boundary the loops ask :func:`stop_requested`: one all-reduce (MAX) over all ranks, so
every rank takes the same decision at the same step even when only one got the signal. Then
:func:`save_and_exit` writes the checkpoint of that step (atomic, see
:mod:`alignment.training.checkpoint`), shuts down and exits with :data:`PREEMPTED_EXIT_CODE`.
The next run with the same ``output_dir`` resumes from it (``trainer.resume=true``); the data
of a step is a function of the step number in every loop, so it continues where it stopped.
"""

from __future__ import annotations

import os
import signal
import threading

from launchers.teardown import close_job
from parallel.state import on_gpu

PREEMPTED_EXIT_CODE = 75  # EX_TEMPFAIL (sysexits.h): stopped on request, a checkpoint is saved: run again
STOP_FILE_ENV = "MEGALIGN_STOP_FILE"

_received: list[str] = []  # names of the signals received, in order


def _handler(signum, frame) -> None:  # noqa: ARG001 - signal handler signature
    if signum == signal.SIGTERM and "SIGTERM" in _received:
        # a second SIGTERM: the process did not reach a step boundary (e.g. blocked on a dead
        # peer); die as without the handler
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)
    _received.append(signal.Signals(signum).name)


def install(signals: tuple[int, ...] = (signal.SIGUSR1, signal.SIGTERM)) -> None:
    """Make ``signals`` set the stop flag instead of killing the process (a second SIGTERM still
    kills it). Idempotent; a no-op outside the main thread (Python only delivers signals there)."""
    if threading.current_thread() is not threading.main_thread():
        return
    for s in signals:
        if signal.getsignal(s) is not _handler:
            signal.signal(s, _handler)


def local_request() -> str | None:
    """Why this process should stop (a signal name, or ``"stop file"``), or None. Not collective."""
    if _received:
        return _received[0]
    path = os.environ.get(STOP_FILE_ENV)
    if path and os.path.exists(path):
        return "stop file"
    return None


def stop_requested() -> bool:
    """True on every rank when any rank was asked to stop. Collective (one 1-element all-reduce
    over the default group): call it at the same point of every step on every rank."""
    import torch
    import torch.distributed as dist

    flag = 1.0 if local_request() else 0.0
    if not dist.is_initialized():
        return bool(flag)
    t = torch.tensor([flag], device=torch.cuda.current_device() if on_gpu() else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def save_and_exit(job, step: int, checkpoint, engine=None) -> None:
    """Write the checkpoint of ``step`` with the loop's own ``checkpoint(step)`` (collective),
    close the TensorBoard writer and the rollout ``engine``, shut the process groups down and
    raise ``SystemExit(PREEMPTED_EXIT_CODE)``.

    Args:
        job: the :class:`launchers.common.Run` of this process.
        step: optimizer steps completed (the checkpoint's step; the resumed run starts there).
        checkpoint: the loop's ``checkpoint(step)`` function.
        engine: the vLLM engine to close, if any.
    """
    checkpoint(step)
    close_job(job, f"preempted ({local_request() or 'another rank'}): checkpoint at step {step} saved in "
                   f"{job.out / 'checkpoints'}, exiting with code {PREEMPTED_EXIT_CODE}", engine)
    raise SystemExit(PREEMPTED_EXIT_CODE)
