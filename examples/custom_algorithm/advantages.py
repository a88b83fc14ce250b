"""An advantage estimator of your own: each response's reward minus its group's median (a baseline that one
outlier in the group does not move, where GRPO's mean does).

    algorithm.advantage_estimator=examples.custom_algorithm.advantages:median_baseline

The contract (alignment/algorithms/hooks.py): ``fn(rewards [batch], group_size) -> [batch]``, each prompt's
``group_size`` responses consecutive.
"""

from __future__ import annotations

import torch


def median_baseline(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """``A_i = r_i - median(r_group)``, in reward units; ``torch.median``'s median (for an even group size, the
    lower of the two middle rewards). ``rewards``: ``[batch]``; returns ``[batch]``.

    Raises:
        ValueError: ``batch`` is not a multiple of ``group_size``."""
    if rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards are not groups of {group_size}")
    grouped = rewards.reshape(-1, group_size)
    return (grouped - grouped.median(dim=1, keepdim=True).values).reshape(-1)
