"""Composite rewards: several named reward signals, each optionally whitened over the global
batch, summed with weights into the one scalar reward per sample that the advantage estimators
take (``reward.functions``; the terms are logged one by one, as verl's ``reward_extra_info`` and
TRL's ``reward_funcs`` / ``reward_weights``).

    reward_i = sum_f  w_f * s_f(x_i)                      (whiten_f false)
    reward_i = sum_f  w_f * (s_f(x_i) - mean_f) / (std_f + eps)   (whiten_f true)

``mean_f`` / ``std_f`` are over every sample of the global batch (all data-parallel ranks, each
sample once); ``std_f`` is Bessel-corrected, as the advantage estimators' and verl's
``masked_whiten``. Whitening puts signals of different scales (a reward model's logits, a 0/1
grader, a length in tokens) on one footing before the weights apply.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any
from dataclasses import dataclass, field

import torch
from torch import Tensor

__all__ = ["RewardTerm", "combine_rewards", "whiten_scores"]

EPS = 1e-6


@dataclass(frozen=True)
class RewardTerm:
    """One entry of ``reward.functions``: its ``name`` (logged as ``reward/<name>``), its ``weight``
    in the sum, whether its scores are whitened over the global batch first, the ``function`` that
    computes them (a built-in's name or ``package.module:function``; "": ``name``) and that
    function's options (``kwargs``)."""

    name: str
    weight: float = 1.0
    whiten: bool = False
    function: str = ""
    kwargs: dict[str, Any] = field(default_factory=dict, compare=False)

    @property
    def runs(self) -> str:
        """The function that computes this term's scores."""
        return self.function or self.name

    def __post_init__(self) -> None:
        if not math.isfinite(self.weight):
            raise ValueError(f"reward.functions[{self.name}].weight={self.weight}: must be a finite number")


def whiten_scores(scores: Tensor, all_reduce: Callable[[list[float]], list[float]] | None = None) -> Tensor:
    """``(scores - mean) / (std + 1e-6)`` with ``mean`` and the Bessel-corrected ``std`` over the
    global batch.

    Args:
        scores: ``[N]`` this rank's scores (float; NaN: no score, left out of the statistics).
        all_reduce: sums a list of floats over the data-parallel ranks (None: this rank is the
            whole batch); called twice (the mean, then the centred squares).
    Returns:
        ``[N]`` float32 (NaN where ``scores`` is); zeros when the batch has fewer than 2 scores.
    """
    x = scores.to(torch.float64)  # two passes in float64: a small spread around a large mean survives
    known = ~torch.isnan(x)
    n, s1 = _summed([float(known.sum()), x[known].sum().item()], all_reduce)
    if n < 2:
        return torch.where(known, 0.0, x).to(torch.float32)
    mean = s1 / n
    [sq] = _summed([((x[known] - mean) ** 2).sum().item()], all_reduce)
    std = float(max(sq / (n - 1), 0.0) ** 0.5)
    return ((x - mean) / (std + EPS)).to(torch.float32)


def _summed(values: list[float], all_reduce: Callable[[list[float]], list[float]] | None) -> list[float]:
    return all_reduce(values) if all_reduce is not None else values


def combine_rewards(scores: dict[str, Tensor], terms: Sequence[RewardTerm],
                    all_reduce: Callable[[list[float]], list[float]] | None = None) -> Tensor:
    """The weighted sum of the terms' (optionally whitened) scores.

    A NaN score (the function does not apply to that sample: TRL's None) adds nothing to the
    sample's sum, as TRL's ``nansum`` over its reward functions.

    Args:
        scores: name -> ``[N]`` raw scores of this rank's samples, for every term.
        terms: the :class:`RewardTerm` s, in config order.
        all_reduce: sums floats over the data-parallel ranks, for whitened terms (collective: every
            rank calls it once per whitened term, in order).
    Returns:
        ``[N]`` float32 rewards.
    Raises:
        ValueError: no terms, a term without scores, or scores of different lengths.
    """
    if not terms:
        raise ValueError("reward.functions is empty: give at least one reward function")
    missing = [t.name for t in terms if t.name not in scores]
    if missing:
        raise ValueError(f"no scores for reward function(s) {missing}; have {sorted(scores)}")
    sizes = {t.name: scores[t.name].numel() for t in terms}
    if len(set(sizes.values())) > 1:
        raise ValueError(f"reward functions scored different numbers of samples: {sizes}")
    total = torch.zeros(next(iter(sizes.values())), dtype=torch.float32)
    for t in terms:
        s = scores[t.name].to(torch.float32)
        total += torch.nan_to_num(t.weight * (whiten_scores(s, all_reduce) if t.whiten else s), nan=0.0)
    return total
