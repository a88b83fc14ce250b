"""Group-relative advantage estimators for GRPO-style training.

Pure tensor math: no process groups, no models.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

__all__ = ["grpo_advantages", "ADVANTAGE_ESTIMATORS", "get_advantage_estimator"]


def grpo_advantages(
    rewards: Tensor,
    group_size: int,
    normalize_by_std: bool = True,
    eps: float = 1e-6,
) -> Tensor:
    """Group-normalised outcome advantages (GRPO).

    Consecutive blocks of ``group_size`` entries form one group: the responses
    sampled for a single prompt, in the order vLLM's
    ``SamplingParams(n=group_size)`` returns them.

    ``A_i = (r_i - mean(r_group)) / (std(r_group) + eps)`` where ``std`` is the
    unbiased (Bessel-corrected, ``torch.std`` default) sample standard
    deviation, as in Shao et al. 2024 "DeepSeekMath", Sec. 4.1.2 (outcome
    supervision) and the NeMo-RL / verl GRPO implementations. With
    ``normalize_by_std=False`` it is just ``r_i - mean(r_group)`` (Dr. GRPO,
    Liu et al. 2025 "Understanding R1-Zero-Like Training"). A group of size 1
    has an undefined std; it is taken as 0, so its advantage is 0.

    Args:
        rewards: ``[batch]`` scalar reward per response (any unit; the result
            is unitless when normalised, in reward units otherwise).
        group_size: responses per prompt; ``batch`` must be a multiple of it.
        normalize_by_std: divide by the group std (GRPO) or not (Dr. GRPO).
        eps: added to the std to avoid division by zero (all-equal groups).

    Returns:
        ``[batch]`` advantages, same dtype/device as ``rewards`` (callers
        normally pass detached rewards; no detach is done here).

    Raises:
        ValueError: ``rewards`` is not 1-D, ``group_size < 1``, or
            ``batch`` is not a multiple of ``group_size``.
    """
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [batch], got shape {tuple(rewards.shape)}")
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got group_size={group_size}")
    if rewards.numel() % group_size != 0:
        raise ValueError(
            f"batch size {rewards.numel()} is not a multiple of group_size={group_size}"
        )
    grouped = rewards.reshape(-1, group_size)
    centered = grouped - grouped.mean(dim=1, keepdim=True)
    if normalize_by_std:
        if group_size == 1:
            # std undefined for one sample; centered is already exactly 0.
            std = torch.zeros_like(grouped)
        else:
            std = grouped.std(dim=1, keepdim=True)  # unbiased (N-1)
        centered = centered / (std + eps)
    return centered.reshape(-1)


ADVANTAGE_ESTIMATORS: dict[str, Callable[..., Tensor]] = {"grpo": grpo_advantages}


def get_advantage_estimator(name: str) -> Callable[..., Tensor]:
    """Look up an advantage estimator by name in ``ADVANTAGE_ESTIMATORS``.

    Raises:
        ValueError: unknown ``name``; the message lists the valid names.
    """
    try:
        return ADVANTAGE_ESTIMATORS[name]
    except KeyError:
        raise ValueError(
            f"unknown advantage estimator {name!r}; valid names: {sorted(ADVANTAGE_ESTIMATORS)}"
        ) from None
