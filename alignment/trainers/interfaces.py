"""The contract between the loop (:mod:`launchers.loop`) and what a job plugs into it: the batch a job's
``collect`` returns (:class:`Batch`) and its held-out evaluation (:class:`Evaluation`). The trainers implement
them (:class:`alignment.trainers.heldout.HeldoutAccuracy`, :class:`alignment.trainers.rl_phases.Rollout`); the
launchers build the job from them (:class:`launchers.loop.JobSpec`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol


class Batch(Protocol):
    """What a job's ``collect(items, step, version)`` returns: one step's batch for this rank (an online job's
    :class:`alignment.trainers.rl_phases.Rollout`; an offline job's examples)."""

    #: wall seconds its collection took
    seconds: float
    #: the step it is for (set by the loop's queue)
    step: int


class Evaluation(Protocol):
    """A job's held-out evaluation, called by the loop at fixed points (collective)."""

    def baseline(self) -> None:
        """Before a resume loads trained weights: measure what must be the initial policy's."""

    def before(self, step: int) -> dict[str, float]:
        """Before the first step of this run (``trainer.eval_before``): metrics to log at ``step``."""

    def beside_first_step(self) -> Callable[[], dict[str, float]] | None:
        """Once the first step's batch is collected: start what :meth:`before` deferred to run beside
        the step's training, and return the function (collective) that waits for it, called after
        the training and before the weight sync, giving the metrics to log at the start step; None:
        nothing deferred."""

    def measure(self, step: int) -> dict[str, float]:
        """The current policy's held-out metrics after ``step`` optimizer steps (every ``trainer.eval_every``)."""

    def final(self) -> tuple[dict[str, float], dict[str, Any], str]:
        """After training: (metrics to log, summary entries, the line to print)."""
