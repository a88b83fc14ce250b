"""A whole algorithm of your own, in one file: GRPO whose baseline is a quantile of each group's rewards (the
median by default), where GRPO's is their mean, and with no division by their spread.

    megalign train algorithm.name=examples.custom_algorithm.quantile_grpo:ALGORITHM algorithm.baseline_quantile=0.5

An algorithm is three things (alignment/algorithms/registry.py):

- its ``algorithm`` section, :class:`QuantileGRPOConfig`: GRPO's step settings (clipping, KL, aggregation, dynamic
  sampling, ...) and its own key, ``baseline_quantile``. It has no ``advantage_estimator``: this algorithm would
  not read one, so ``algorithm.advantage_estimator=...`` is refused rather than ignored;
- its trainer, this module: :func:`collect` samples and scores as GRPO does; :func:`train` computes its advantages,
  then runs GRPO's step on them;
- its record, :data:`ALGORITHM`: the job that runs it, the trainer module, the section, what it can do, its checks
  across sections (GRPO's step's: ``alignment/checks/grpo.py``), and the built-in whose other settings
  (``rollout``, ``data``, ``trainer``) it reads as its own (``like="grpo"``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from alignment.algorithms.config import GRPOFamilyConfig
from alignment.algorithms.registry import Algorithm
from alignment.schema import ranged
from alignment.trainers import grpo


@dataclass
class QuantileGRPOConfig(GRPOFamilyConfig):
    """``algorithm`` for :data:`ALGORITHM`: GRPO's step settings and the baseline's quantile."""

    # the quantile of each group's rewards subtracted from each reward (0.5: the median; torch.quantile's
    # "lower" interpolation, so always one of the group's own rewards)
    baseline_quantile: float = ranged(0.5, 0, 1, high_in=True)


def quantile_advantages(rewards: torch.Tensor, group_size: int, quantile: float) -> torch.Tensor:
    """``A_i = r_i - q(r_group)``, in reward units, ``q`` the group's ``quantile`` (``torch.quantile`` with
    ``interpolation="lower"``: at 0.5, ``torch.median``'s lower median). ``rewards``: ``[batch]``, each prompt's
    ``group_size`` responses consecutive; returns ``[batch]`` float32.

    Raises:
        ValueError: ``batch`` is not a multiple of ``group_size``."""
    if rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards are not groups of {group_size}")
    grouped = rewards.float().reshape(-1, group_size)
    baseline = torch.quantile(grouped, quantile, dim=1, keepdim=True, interpolation="lower")
    return (grouped - baseline).reshape(-1)


collect = grpo.collect  # GRPO's sampling and scoring, as is


def train(models, rollout, cfg):
    """The trainer step: this algorithm's advantages, then GRPO's step on them (reference and old logprobs, the
    clipped surrogate). Returns what :func:`alignment.trainers.grpo.train` does: (global metrics, phase seconds)."""
    advantages = quantile_advantages(rollout.rewards, cfg.rollout.group_size, cfg.algorithm.baseline_quantile)
    return grpo.train(models, rollout, cfg, advantages=advantages)


ALGORITHM = Algorithm("quantile_grpo", "online", __name__, "GRPO with a quantile (median) baseline",
                      QuantileGRPOConfig, asks_task=True, policy_gradient=True,
                      validate="alignment.checks.grpo:validate", like="grpo")
