"""Advantage estimators: group-relative (GRPO, Dr. GRPO, RLOO, REINFORCE++)
and token-level GAE for critic-based PPO.

Pure tensor math: no process groups, no models.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch
from torch import Tensor

from alignment.algorithms import hooks

__all__ = [
    "grpo_advantages",
    "rloo_advantages",
    "reinforce_plus_plus_advantages",
    "gae",
    "ADVANTAGE_ESTIMATORS",
    "get_advantage_estimator",
]


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


def _check_grouped(rewards: Tensor, group_size: int, min_group_size: int) -> None:
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [batch], got shape {tuple(rewards.shape)}")
    if group_size < min_group_size:
        raise ValueError(
            f"group_size must be >= {min_group_size}, got group_size={group_size}"
        )
    if rewards.numel() % group_size != 0:
        raise ValueError(
            f"batch size {rewards.numel()} is not a multiple of group_size={group_size}"
        )


def rloo_advantages(rewards: Tensor, group_size: int) -> Tensor:
    """REINFORCE Leave-One-Out (RLOO) outcome advantages.

    Consecutive blocks of ``group_size`` entries form one group (the responses
    to one prompt). Each sample's baseline is the mean reward of the *other*
    ``G - 1`` samples of its group (Ahmadian et al. 2024, "Back to Basics:
    Revisiting REINFORCE Style Optimization for Learning from Human Feedback
    in LLMs", Sec. 3.2; Kool et al. 2019)::

        A_i = r_i - 1/(G-1) * sum_{j != i} r_j  =  G/(G-1) * (r_i - mean(r_group))

    No std normalisation; the result is in reward units. verl's
    ``compute_rloo_outcome_advantage`` (``core_algos.py``) computes the same.

    Args:
        rewards: ``[batch]`` scalar reward per response.
        group_size: responses per prompt ``G``; ``batch`` must be a multiple.

    Returns:
        ``[batch]`` advantages, same dtype/device as ``rewards``.

    Raises:
        ValueError: ``rewards`` is not 1-D, ``group_size < 2`` (the
            leave-one-out mean needs another sample), or ``batch`` is not a
            multiple of ``group_size``.
    """
    _check_grouped(rewards, group_size, min_group_size=2)
    grouped = rewards.reshape(-1, group_size)
    loo_mean = (grouped.sum(dim=1, keepdim=True) - grouped) / (group_size - 1)
    return (grouped - loo_mean).reshape(-1)


def reinforce_plus_plus_advantages(
    rewards: Tensor,
    group_size: int | None = None,
    eps: float = 1e-6,
    *,
    token_counts: Tensor | None = None,
    all_reduce: Callable[[list[float]], list[float]] | None = None,
) -> Tensor:
    """REINFORCE++ outcome advantages: global-batch whitening.

    Hu 2025, "REINFORCE++: A Simple and Efficient Approach for Aligning Large
    Language Models", Sec. 3 (advantage normalisation over the global batch)::

        A = (r - mean(r)) / (std(r) + eps)          # mean/std over the whole batch

    With ``group_size`` given (REINFORCE++-baseline, same paper, and verl's
    ``compute_reinforce_plus_plus_baseline_outcome_advantage``), each reward
    first has its group mean subtracted (consecutive blocks of ``group_size``),
    then the centred values are whitened over the whole batch::

        c_i = r_i - mean(r_group(i));   A = (c - mean(c)) / (std(c) + eps)

    ``std`` is the unbiased (Bessel-corrected) sample std, as in
    :func:`grpo_advantages` and verl's ``masked_whiten``; a batch of one has std
    taken as 0 (advantage 0). What the mean and std average over is a choice
    (``algorithm.whiten_level``): each response once (``token_counts=None``,
    the paper's per-sample statement; megalign's default), or every valid token
    (``token_counts``: response ``i`` weighted by its length, as verl and
    OpenRLHF do after broadcasting the scalar over the response's tokens, which
    weights long responses more). The token-level KL-in-reward term of
    REINFORCE++ is not applied here (see :func:`alignment.algorithms.kl.kl_in_reward`).

    Args:
        rewards: ``[batch]`` scalar reward per response (this data-parallel rank's).
        group_size: responses per prompt for the -baseline variant, or
            ``None`` for plain REINFORCE++ (no group centring).
        eps: added to the std to avoid division by zero.
        token_counts: ``[batch]`` valid tokens of each response, for token-level
            whitening; ``None``: response-level.
        all_reduce: sums a list of floats over the data-parallel group, so that the
            mean and std are the global batch's; ``None``: ``rewards`` is the whole batch.

    Returns:
        ``[batch]`` unitless advantages, same dtype/device as ``rewards``.

    Raises:
        ValueError: ``rewards`` is not 1-D or empty, ``group_size < 1``,
            ``batch`` is not a multiple of ``group_size``, or ``token_counts``
            is not ``[batch]``.
    """
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [batch], got shape {tuple(rewards.shape)}")
    if rewards.numel() == 0:
        raise ValueError("rewards must be non-empty")
    if token_counts is not None and token_counts.shape != rewards.shape:
        raise ValueError(f"token_counts must be [batch] = {tuple(rewards.shape)}, got {tuple(token_counts.shape)}")
    x = rewards
    if group_size is not None:
        _check_grouped(rewards, group_size, min_group_size=1)
        grouped = rewards.reshape(-1, group_size)
        x = (grouped - grouped.mean(dim=1, keepdim=True)).reshape(-1)
    w = torch.ones_like(x, dtype=torch.float64) if token_counts is None else token_counts.to(torch.float64)
    xd = x.to(torch.float64)
    sums = [w.sum().item(), (w * xd).sum().item(), (w * xd * xd).sum().item()]
    n, s1, s2 = all_reduce(sums) if all_reduce is not None else sums
    if n <= 1:
        return torch.zeros_like(x)
    mean = s1 / n
    std = float(max((s2 - n * mean * mean) / (n - 1), 0.0) ** 0.5)
    if std == 0.0:  # all equal: no signal (and no 0 / 0 with eps=0)
        return torch.zeros_like(x)
    return (x - mean) / (std + eps)


def gae(
    rewards: Tensor,
    values: Tensor,
    mask: Tensor,
    gamma: float,
    gae_lambda: float,
    last_values: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Token-level Generalised Advantage Estimation.

    Schulman et al. 2016, "High-Dimensional Continuous Control Using
    Generalized Advantage Estimation", eq. 16, computed by the backward
    recursion over the *valid* tokens of each row::

        delta_t = r_t + gamma * V_next - V_t
        A_t     = delta_t + gamma * lambda * A_next

    where ``V_next``/``A_next`` are the value/advantage of the next valid
    token (positions with ``mask == 0`` are skipped, not treated as steps),
    and after the last valid token ``V_next = last_values`` (default 0: the
    episode terminated) and ``A_next = 0``. ``returns = advantages + values``
    (the critic target). Same as verl's ``compute_gae_advantage_return``
    (``core_algos.py``) but without its final advantage whitening.

    Special cases: ``lambda = 1`` gives the discounted return-to-go minus
    ``V_t`` (Monte-Carlo); ``lambda = 0`` gives the one-step TD error.

    Args:
        rewards: ``[batch, seq]`` per-token rewards (e.g. from
            :func:`alignment.algorithms.kl.kl_in_reward`); ignored where
            ``mask == 0``.
        values: ``[batch, seq]`` critic values ``V(s_t)``, same units as rewards.
        mask: ``[batch, seq]`` 1/True for valid response tokens, 0/False else.
        gamma: discount factor in ``[0, 1]``.
        gae_lambda: GAE lambda in ``[0, 1]``.
        last_values: optional ``[batch]`` bootstrap value after each row's last
            valid token (truncated episodes); ``None`` means 0 (terminal).

    Returns:
        ``(advantages, returns)``, both ``[batch, seq]`` in reward units,
        exactly 0 where ``mask == 0``. No detach is done (callers pass
        detached rewards/values).

    Raises:
        ValueError: ``rewards`` is not 2-D, ``values``/``mask`` shapes differ
            from it, ``last_values`` is not ``[batch]``, or ``gamma`` /
            ``gae_lambda`` is outside ``[0, 1]``.
    """
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be 2-D [batch, seq], got shape {tuple(rewards.shape)}")
    if values.shape != rewards.shape:
        raise ValueError(
            f"values shape {tuple(values.shape)} != rewards shape {tuple(rewards.shape)}"
        )
    if mask.shape != rewards.shape:
        raise ValueError(
            f"mask shape {tuple(mask.shape)} != rewards shape {tuple(rewards.shape)}"
        )
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"gamma must be in [0, 1], got gamma={gamma}")
    if not 0.0 <= gae_lambda <= 1.0:
        raise ValueError(f"gae_lambda must be in [0, 1], got gae_lambda={gae_lambda}")
    batch, seq = rewards.shape
    dtype = torch.promote_types(rewards.dtype, values.dtype)
    if last_values is None:
        next_value = torch.zeros(batch, dtype=dtype, device=rewards.device)
    else:
        if last_values.shape != (batch,):
            raise ValueError(
                f"last_values must be [batch]=({batch},), got shape {tuple(last_values.shape)}"
            )
        next_value = last_values.to(dtype)
    valid = mask.bool()
    r = rewards.to(dtype)
    v = values.to(dtype)
    next_adv = torch.zeros(batch, dtype=dtype, device=rewards.device)
    zero = torch.zeros((), dtype=dtype, device=rewards.device)
    adv_cols: list[Tensor] = []
    for step in reversed(range(seq)):
        m = valid[:, step]
        delta = r[:, step] + gamma * next_value - v[:, step]
        a = delta + gamma * gae_lambda * next_adv
        # invalid positions: output 0 and carry the next valid token's state through
        next_adv = torch.where(m, a, next_adv)
        next_value = torch.where(m, v[:, step], next_value)
        adv_cols.append(torch.where(m, a, zero))
    if adv_cols:
        advantages = torch.stack(adv_cols[::-1], dim=1)
    else:
        advantages = torch.zeros(batch, 0, dtype=dtype, device=rewards.device)
    returns = torch.where(valid, advantages + v, zero)
    return advantages, returns


def _reinforce_plus_plus_global(rewards: Tensor, group_size: int, **whitening: Any) -> Tensor:
    # registry adapter: plain REINFORCE++ ignores the grouping
    return reinforce_plus_plus_advantages(rewards, **whitening)


def _reinforce_plus_plus_baseline(rewards: Tensor, group_size: int, **whitening: Any) -> Tensor:
    return reinforce_plus_plus_advantages(rewards, group_size=group_size, **whitening)


#: estimators whose normalisation is over the global batch: they take ``token_counts`` and
#: ``all_reduce`` keywords (:func:`reinforce_plus_plus_advantages`)
BATCH_WHITENED = ("reinforce_plus_plus", "reinforce_plus_plus_baseline")


#: Name -> estimator. Every entry except ``"gae"`` is an outcome estimator
#: callable as ``fn(rewards [batch], group_size) -> [batch]`` (extra keyword
#: arguments only where the underlying function takes them). ``"gae"`` is
#: :func:`gae` with its own signature ``(rewards [B,T], values [B,T],
#: mask [B,T], gamma, gae_lambda, last_values=None) -> (advantages, returns)``.
ADVANTAGE_ESTIMATORS: dict[str, Callable[..., Any]] = {
    "grpo": grpo_advantages,
    "grpo_no_std": functools.partial(grpo_advantages, normalize_by_std=False),
    "rloo": rloo_advantages,
    "reinforce_plus_plus": _reinforce_plus_plus_global,
    "reinforce_plus_plus_baseline": _reinforce_plus_plus_baseline,
    "gae": gae,
}


def get_advantage_estimator(name: str) -> Callable[..., Any]:
    """Look up an advantage estimator by name in ``ADVANTAGE_ESTIMATORS``, or your own by import path
    (``module.path:function``: ``fn(rewards [batch], group_size) -> [batch]``, :mod:`alignment.algorithms.hooks`).

    See ``ADVANTAGE_ESTIMATORS`` for the call signatures (``"gae"`` differs
    from the group estimators).

    Raises:
        ValueError: unknown ``name``; the message lists the valid names (a
            :class:`alignment.schema.ConfigError` for an import path that does not load).
    """
    if hooks.is_import_path(name):
        return hooks.load(name, "algorithm.advantage_estimator")
    try:
        return ADVANTAGE_ESTIMATORS[name]
    except KeyError:
        raise ValueError(
            f"unknown advantage estimator {name!r}; valid names: {sorted(ADVANTAGE_ESTIMATORS)}"
        ) from None
