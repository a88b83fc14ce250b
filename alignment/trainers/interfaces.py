"""The contract between the loop (:mod:`launchers.loop`) and what a job plugs into it (:class:`JobSpec`): the
batch a job's ``collect`` returns (:class:`Batch`) and its held-out evaluation (:class:`Evaluation`). The trainers
implement them (:class:`alignment.trainers.heldout.HeldoutAccuracy`, :class:`alignment.trainers.rl_phases.Rollout`);
the launchers build a :class:`JobSpec` from them and hand it to the loop."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from alignment.data.samples import SamplingConfig


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


class CarriedPool(Protocol):
    """Partial rollouts carried across steps (``rollout.partial_carry_over``; :class:`launchers.carried.CarriedPrompts`):
    what the loop asks of the pool of prompts in flight."""

    def save(self, step: int) -> dict[str, str]:
        """The files checkpoint ``step`` keeps of the prompts in flight (name -> text; collective): with the groups
        taken for step ``step`` when that step has not trained (a checkpoint saved before it)."""

    def start(self, step: int, end: int, saved: dict[str, Any] | None) -> None:
        """The run trains steps ``step .. end - 1``; ``saved``: what the checkpoint it resumes kept of the prompts
        in flight (None: a fresh start)."""

    def metrics(self, info: dict[str, float]) -> dict[str, float]:
        """The step's pool metrics over the global batch, from the rollout's ``info`` (collective)."""


#: the progress bar's postfix of an online job: shown name -> (metric, format)
RL_POSTFIX = {"reward": ("reward/mean", ".3f"), "kl": ("kl", ".4f"), "accept": ("rft/acceptance_rate", ".2f")}


@dataclass
class JobSpec:
    """One job plugged into the loop (:func:`launchers.loop.run`), built by its launcher.

    ``name``: progress-bar label. ``train_set``: prompts, problems or examples, sliced per step and
    DP rank by ``items(step)`` (default: :func:`launchers.loop.prompts_of_step` with ``rollout.prompts_per_step``).
    ``collect(items, step, version)``: this DP rank's batch for ``items`` (online: the
    :class:`alignment.trainers.rl_phases.Rollout` sampled by the policy after ``version`` optimizer
    steps), an object with ``seconds`` (its wall time) and a ``step`` the loop sets.
    ``train(batch)``: (global metrics, phase seconds); a ``tokens`` metric (the step's tokens) is
    turned into ``tokens_per_s``. ``trained``: name -> (model, optimizer) of what checkpoints hold
    (optimizer None: a frozen model whose weights still change, e.g. iterative DPO's reference).
    ``evaluation``: see :class:`Evaluation`. ``request(items)``: the ``(prompts, SamplingConfig)``
    of the first generation ``collect(items, ...)`` asks for, so that an engine on rollout ranks of
    its own can start it early (:class:`launchers.loop.RolloutQueue`'s ``post``). ``steps``: the run's optimizer
    steps (default: :func:`alignment.config.total_steps`). ``log_prefix``: put before each step metric's TensorBoard
    name (offline jobs: ``train/``). ``postfix``: the progress bar's (name -> (metric, format)).
    ``hf_config``: the HF config written with the export (default: the job's); ``export_adapters``:
    with ``model.lora``, also write the PEFT adapters. ``carried``: the pool of partial rollouts carried across
    steps (``rollout.partial_carry_over``): the queue samples no batch ahead (the pool admits the prompts of the
    next ``max_staleness`` steps itself), and checkpoints keep its prompts in flight.
    """

    name: str
    train_set: Sequence[Any]
    collect: Callable[[list[Any], int, int], Batch]
    train: Callable[[Any], tuple[dict[str, float], dict[str, float]]]
    trained: dict[str, tuple[torch.nn.Module, Any]]
    evaluation: Evaluation
    request: Callable[[list[Any]], tuple[list[Any], SamplingConfig]] | None = None
    items: Callable[[int], list[Any]] | None = None
    steps: int | None = None
    log_prefix: str = ""
    postfix: dict[str, tuple[str, str]] = field(default_factory=lambda: dict(RL_POSTFIX))
    hf_config: Any = None
    export_adapters: bool = True
    carried: CarriedPool | None = None
