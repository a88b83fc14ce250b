"""Per-token critic (value-function) loss with optional PPO value clipping."""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["value_loss"]


def value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    cliprange_value: float | None,
) -> Tensor:
    """Per-token squared-error value loss, optionally clipped (to minimise).

    Unclipped: ``0.5 * (values - returns)**2``. With value clipping (OpenAI
    baselines PPO2 ``ppo2/model.py``; verl ``core_algos.compute_value_loss``)::

        v_clipped = old_values + clamp(values - old_values, -c, c)
        loss      = 0.5 * max((values - returns)**2, (v_clipped - returns)**2)

    Gradient flows through ``values`` only; ``old_values`` and ``returns``
    are detached. No masking / aggregation is applied (use
    :func:`alignment.algorithms.aggregation.aggregate`).

    Args:
        values: ``[batch, seq]`` value predictions of the critic being trained.
        old_values: ``[batch, seq]`` value predictions of the critic at rollout
            time (the clipping centre).
        returns: ``[batch, seq]`` regression targets (e.g. GAE returns).
        cliprange_value: clip half-width ``c > 0``, or None for no clipping.

    Returns:
        ``[batch, seq]`` per-token loss.

    Raises:
        ValueError: ``cliprange_value <= 0`` or shapes are not the same
            ``[batch, seq]``.
    """
    if values.dim() != 2 or values.shape != old_values.shape or values.shape != returns.shape:
        raise ValueError(
            f"values {tuple(values.shape)}, old_values {tuple(old_values.shape)} and "
            f"returns {tuple(returns.shape)} must all be the same [batch, seq]"
        )
    if cliprange_value is not None and not cliprange_value > 0:
        raise ValueError(
            f"cliprange_value must be > 0 (or None), got cliprange_value={cliprange_value}"
        )
    returns = returns.detach()
    loss_unclipped = (values - returns) ** 2
    if cliprange_value is None:
        return 0.5 * loss_unclipped
    old = old_values.detach()
    v_clipped = old + torch.clamp(values - old, -cliprange_value, cliprange_value)
    loss_clipped = (v_clipped - returns) ** 2
    return 0.5 * torch.maximum(loss_unclipped, loss_clipped)
