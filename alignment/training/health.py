"""Training health: an update whose gradients hold a NaN or an inf anywhere is skipped (the
weights, Adam's moments and its step count untouched) and counted (``health/skipped_updates``);
``trainer.max_bad_steps`` consecutive steps with a skipped update stop the run with a message and a
checkpoint of the state the skipped updates left alone. Bounds on logged metrics
(``trainer.warn_on``, ``trainer.stop_on``: entropy collapse, runaway KL, ...) warn or stop
(:func:`crossed_bounds`).

Megatron's optimizers skip on inf only under fp16 loss scaling; in bf16 and fp32 a NaN gradient
would go through the gradient clipping (a NaN norm) into every parameter.
"""

from __future__ import annotations

import torch

from alignment.training.grad_stats import grad_group_norms
from alignment.training.megatron_step import all_reduce_max

__all__ = ["grads_finite", "guarded_step", "BadStepStreak", "TrainingDiverged", "crossed_bounds", "TrainingStopped",
           "HealthMonitor"]


class TrainingDiverged(RuntimeError):
    """``trainer.max_bad_steps`` consecutive steps had non-finite gradients."""


def grads_finite(model: torch.nn.Module) -> bool:
    """Whether every gradient of ``model`` (Megatron DDP's ``main_grad`` buffers, else ``.grad``) is
    finite on every rank. Collective over all ranks (one all-reduce), so every rank takes the same
    decision; a NaN on one data-parallel rank is seen before any reduction spreads it. Costs one
    pass over the gradients and one host sync."""
    flags = []
    for p in model.parameters():
        g = getattr(p, "main_grad", None)
        g = p.grad if g is None else g
        if g is not None:
            flags.append(torch.isfinite(g).all())
    bad = 0.0 if not flags or bool(torch.stack(flags).all()) else 1.0  # one device sync, not one per parameter
    return all_reduce_max([bad])[0] == 0.0


def guarded_step(model: torch.nn.Module, optimizer, group_norms: dict | None = None) -> tuple[bool, float]:
    """``optimizer.step()`` unless a gradient of ``model`` is NaN/inf on some rank (:func:`grads_finite`).
    ``group_norms``: an empty dict, filled (before the step clips the gradients) with
    :func:`alignment.training.grad_stats.grad_group_norms` (``trainer.grad_stats_every``); None: not measured.

    Returns:
        ``(applied, grad_norm)``: ``(True, the step's gradient norm)``, or ``(False, nan)`` when the
        update was skipped (nothing changed; the next ``zero_grad_buffer`` clears the gradients).
    """
    if not grads_finite(model):
        return False, float("nan")
    if group_norms is not None and not group_norms:  # a step's first update

        group_norms.update(grad_group_norms(model, optimizer))
    _, norm, _ = optimizer.step()
    return True, float(norm) if norm is not None else 0.0


class BadStepStreak:
    """Counts consecutive training steps with a skipped update (``trainer.max_bad_steps``, 0: never
    stop). :meth:`update` after every step."""

    def __init__(self, max_bad_steps: int):
        self.max_bad_steps, self.streak, self.first = max_bad_steps, 0, None

    def update(self, step: int, skipped: float) -> bool:
        """Record step ``step`` (1-based) with ``skipped`` updates skipped; returns whether the run
        must stop now (``max_bad_steps`` consecutive bad steps)."""
        if not skipped:
            self.streak, self.first = 0, None
            return False
        self.streak += 1
        self.first = step if self.first is None else self.first
        return bool(self.max_bad_steps) and self.streak >= self.max_bad_steps

    def error(self, checkpoint: str) -> TrainingDiverged:
        """The error that stops the run, naming the steps, the checkpoint saved and the fixes."""
        last = self.first + self.streak - 1
        return TrainingDiverged(
            f"steps {self.first}-{last}: {self.streak} consecutive steps had NaN/inf gradients and their updates were "
            f"skipped (health/skipped_updates; trainer.max_bad_steps={self.max_bad_steps}), so the run stopped. The "
            f"weights and optimizer state those updates left alone are saved in {checkpoint}. Lower trainer.lr, "
            "check the data of those steps, or raise trainer.max_bad_steps (0: never stop)")


class TrainingStopped(RuntimeError):
    """A metric crossed one of ``trainer.stop_on``'s bounds."""


def crossed_bounds(metrics: dict[str, float], bounds, kind: str) -> list[str]:
    """One message per bound of ``bounds`` (``trainer.warn_on`` / ``stop_on`` entries: ``metric``,
    ``below``, ``above``) that ``metrics`` crosses; a NaN metric crosses every bound.

    Raises:
        KeyError: a bound names a metric the job does not log (the message lists those it does).
    """
    out = []
    for b in bounds:
        if b.metric not in metrics:
            raise KeyError(f"trainer.{kind} names the metric {b.metric!r}, which this job does not log; it logs: "
                           f"{', '.join(sorted(metrics))}")
        v = float(metrics[b.metric])
        if b.below is not None and not v >= b.below:
            out.append(f"{b.metric} = {v:.6g} is below {b.below:g} (trainer.{kind})")
        if b.above is not None and not v <= b.above:
            out.append(f"{b.metric} = {v:.6g} is above {b.above:g} (trainer.{kind})")
    return out


class HealthMonitor:
    """What a training loop checks after every step (:mod:`launchers.loop`,
    :mod:`launchers.offline_job`): ``trainer.warn_on`` (printed on rank 0, counted in
    ``health/warnings``), ``trainer.stop_on`` and ``trainer.max_bad_steps`` (the run stops: the loop
    saves a checkpoint, then raises :meth:`error`)."""

    def __init__(self, trainer, rank: int):
        self.streak = BadStepStreak(trainer.max_bad_steps)
        self.warn_on, self.stop_on, self.rank = list(trainer.warn_on), list(trainer.stop_on), rank
        self.warnings, self.reasons, self.diverged, self.step = 0, [], False, 0

    def check(self, step: int, metrics: dict[str, float]) -> bool:
        """Check step ``step``'s (1-based) ``metrics`` (``health/warnings`` is added to them); returns
        whether the run must stop."""
        warned = crossed_bounds(metrics, self.warn_on, "warn_on")
        self.warnings += len(warned)
        metrics["health/warnings"] = float(self.warnings)
        if self.rank == 0:
            for w in warned:
                print(f"warning: step {step}: {w}", flush=True)
        self.step, self.reasons = step, crossed_bounds(metrics, self.stop_on, "stop_on")
        self.diverged = self.streak.update(step, metrics.get("health/skipped_updates", 0.0))
        return self.diverged or bool(self.reasons)

    def error(self, checkpoint: str) -> RuntimeError:
        """The error that stops the run, after the loop saved ``checkpoint``."""
        if self.diverged:
            return self.streak.error(checkpoint)
        return TrainingStopped(f"step {self.step}: {'; '.join(self.reasons)}, so the run stopped; its state is saved "
                               f"in {checkpoint}. Change the run's settings (or the bound) and resume it")
