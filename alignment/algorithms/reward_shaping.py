"""Reward shaping and rollout filtering from DAPO (Yu et al. 2025, "DAPO: An Open-Source LLM
Reinforcement Learning System at Scale")."""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["overlong_penalty", "informative_groups"]


def overlong_penalty(response_lengths: Tensor, max_tokens: int, buffer_len: int, penalty_factor: float = 1.0) -> Tensor:
    """Soft overlong punishment, DAPO eq. 13 (verl ``overlong_buffer``), added to the task reward.

    With ``L_max = max_tokens`` and ``L_cache = buffer_len``::

        0                                   |y| <= L_max - L_cache
        ((L_max - L_cache) - |y|) / L_cache  L_max - L_cache < |y| <= L_max
        -1                                  |y| > L_max

    times ``penalty_factor``.

    Args:
        response_lengths: ``[batch]`` response lengths in tokens.
        max_tokens: ``L_max``, the response budget (tokens), > 0.
        buffer_len: ``L_cache``, the punishment interval (tokens), in ``(0, max_tokens]``.
        penalty_factor: scale of the penalty, >= 0.
    Returns:
        ``[batch]`` float penalties in ``[-penalty_factor, 0]``.
    Raises:
        ValueError: ``buffer_len`` outside ``(0, max_tokens]`` or a negative ``penalty_factor``.
    """
    if not 0 < buffer_len <= max_tokens:
        raise ValueError(f"algorithm.overlong_buffer_len={buffer_len} must be in (0, rollout.max_tokens={max_tokens}]")
    if penalty_factor < 0:
        raise ValueError(f"algorithm.overlong_penalty_factor={penalty_factor} must be >= 0")
    length = response_lengths.to(torch.float32)
    start = max_tokens - buffer_len
    penalty = torch.clamp((start - length) / buffer_len, max=0.0)
    penalty = torch.where(length > max_tokens, torch.full_like(length, -1.0), penalty)
    return penalty * penalty_factor


def informative_groups(rewards: Tensor, group_size: int) -> Tensor:
    """DAPO dynamic sampling (Sec. 3.2, eq. 11's constraint ``0 < |{correct}| < G``): which prompt
    groups have rewards that are not all equal, i.e. a non-zero group-normalised advantage.

    Args:
        rewards: ``[num_groups * group_size]`` rewards, grouped contiguously.
    Returns:
        ``[num_groups]`` bool.
    Raises:
        ValueError: ``rewards`` is not a whole number of groups.
    """
    if group_size < 1 or rewards.dim() != 1 or rewards.numel() % group_size:
        raise ValueError(f"rewards of shape {tuple(rewards.shape)} is not a whole number of groups of {group_size}")
    g = rewards.reshape(-1, group_size)
    return (g != g[:, :1]).any(dim=1)
