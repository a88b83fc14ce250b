"""A process reward model's step scores as a dense reward: placed on the tokens that end the steps
(PPO: GAE credits each step's reward to the tokens before it), or turned into per-token GRPO
advantages by process supervision (Shao et al. 2024, DeepSeekMath Sec. 4.1.3: every step reward of
a group normalised by the mean and std of all the group's step rewards; a token's advantage is the
sum of the normalised rewards of the steps ending at or after it).

Positions are response-token indices (0 = the first generated token); ``[N, R]`` tensors are in
those coordinates, ``R`` the longest response; :func:`to_batch_columns` moves them to the columns
of :func:`alignment.training.batching.make_batch` (response token ``k`` of a row with a
``p``-token prompt is column ``p + k - 1``, where its log-probability is predicted).
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["place_step_rewards", "process_advantages", "to_batch_columns"]


def _check(step_rewards: list[list[float]], step_positions: list[list[int]], lengths: list[int]) -> None:
    if not len(step_rewards) == len(step_positions) == len(lengths):
        raise ValueError(f"{len(step_rewards)} rows of step rewards, {len(step_positions)} of positions, "
                         f"{len(lengths)} response lengths")
    for i, (rs, ps, n) in enumerate(zip(step_rewards, step_positions, lengths)):
        if len(rs) != len(ps):
            raise ValueError(f"row {i}: {len(rs)} step rewards for {len(ps)} step ends")
        if any(not 0 <= p < n for p in ps) or any(b <= a for a, b in zip(ps, ps[1:])):
            raise ValueError(f"row {i}: step ends {ps} must increase within the {n}-token response")


def place_step_rewards(step_rewards: list[list[float]], step_positions: list[list[int]],
                       lengths: list[int]) -> Tensor:
    """``[N, R]`` (``R = max(lengths)``) holding ``step_rewards[i][k]`` at response token
    ``step_positions[i][k]``, 0 elsewhere: a process reward model's dense reward for PPO.

    Raises:
        ValueError: lists of different lengths, or step ends outside the response or not increasing.
    """
    _check(step_rewards, step_positions, lengths)
    out = torch.zeros(len(lengths), max(lengths, default=0))
    for i, (rs, ps) in enumerate(zip(step_rewards, step_positions)):
        for r, p in zip(rs, ps):
            out[i, p] = float(r)
    return out


def process_advantages(step_rewards: list[list[float]], step_positions: list[list[int]], lengths: list[int],
                       group_size: int, normalize_by_std: bool = True, eps: float = 1e-6) -> Tensor:
    """Per-token GRPO advantages ``[N, R]`` from step rewards (DeepSeekMath Sec. 4.1.3):
    ``r~ = (r - mean(R_g)) / (std(R_g) + eps)`` over every step reward ``R_g`` of the row's group
    (``group_size`` consecutive rows; std unbiased, as :func:`alignment.algorithms.advantages.
    grpo_advantages`; a group with one step has std 0; ``normalize_by_std=False``: ``r - mean``,
    as Dr.GRPO), then ``A[i, t] = sum of r~[i, k] over the steps k with step_positions[i][k] >= t``,
    for ``t < lengths[i]`` (0 past the response). A row without steps has advantage 0.

    Raises:
        ValueError: ``group_size < 1`` or not dividing the rows, or the checks of :func:`place_step_rewards`.
    """
    _check(step_rewards, step_positions, lengths)
    n = len(lengths)
    if group_size < 1 or n % group_size:
        raise ValueError(f"group_size={group_size} must be >= 1 and divide the {n} rows")
    normalised = [[0.0] * len(rs) for rs in step_rewards]
    for g in range(0, n, group_size):
        pooled = torch.tensor([r for rs in step_rewards[g : g + group_size] for r in rs], dtype=torch.float64)
        if pooled.numel() == 0:
            continue
        mean = pooled.mean()
        std = pooled.std() if pooled.numel() > 1 else torch.zeros((), dtype=torch.float64)
        scale = std + eps if normalize_by_std else 1.0
        for i in range(g, g + group_size):
            normalised[i] = [float((r - mean) / scale) for r in step_rewards[i]]
    placed = place_step_rewards(normalised, step_positions, lengths)
    advantages = placed.flip(1).cumsum(1).flip(1)  # sum over the steps ending at or after t
    for i, length in enumerate(lengths):
        advantages[i, length:] = 0.0
    return advantages


def to_batch_columns(per_token: Tensor, prompt_lengths: list[int], seq_len: int) -> Tensor:
    """``per_token`` ``[N, R]`` (response coordinates) as ``[N, seq_len]`` batch columns: response
    token ``k`` of row ``i`` at column ``prompt_lengths[i] + k - 1``, 0 elsewhere.

    Raises:
        ValueError: a row that does not fit in ``seq_len`` columns.
    """
    out = torch.zeros(per_token.shape[0], seq_len, dtype=per_token.dtype)
    for i, p in enumerate(prompt_lengths):
        width = max(0, min(per_token.shape[1], seq_len - p + 1))
        if p < 1 or per_token[i, width:].any():
            raise ValueError(f"row {i}: its response after a {p}-token prompt does not fit in {seq_len} columns")
        out[i, p - 1 : p - 1 + width] = per_token[i, :width]
    return out
