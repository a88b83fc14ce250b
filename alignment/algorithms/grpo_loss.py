"""GRPO per-micro-batch loss: clipped surrogate + KL to the reference policy."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from alignment.algorithms.aggregation import aggregate
from alignment.algorithms.kl import kl_penalty
from alignment.algorithms.policy_loss import ppo_policy_loss

__all__ = ["GRPOLossConfig", "grpo_loss"]


@dataclass
class GRPOLossConfig:
    """Hyper-parameters of :func:`grpo_loss`.

    Defaults follow DeepSeekMath (Shao et al. 2024): epsilon 0.2, beta 0.04,
    k3 KL estimator.
    """

    clip_ratio: float = 0.2
    kl_coef: float = 0.04
    kl_estimator: str = "k3"
    # Variants: DAPO's clip-higher upper bound (None: = clip_ratio) and the aggregation
    # mode (alignment.algorithms.aggregation.AGGREGATION_MODES; Dr.GRPO uses
    # "seq-mean-token-sum-norm"). The normaliser the caller passes must match the mode.
    clip_ratio_high: float | None = None
    loss_agg_mode: str = "token-mean"


def grpo_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    ref_logprobs: Tensor | None,
    advantages: Tensor,
    response_mask: Tensor,
    global_token_count: float | Tensor,
    cfg: GRPOLossConfig,
) -> tuple[Tensor, dict[str, Tensor]]:
    """GRPO loss of one micro-batch (DeepSeekMath, Shao et al. 2024, eq. 3).

    Per token: ``clipped_surrogate + kl_coef * kl_penalty(logprobs, ref)``;
    the KL term is skipped when ``cfg.kl_coef == 0`` or ``ref_logprobs`` is
    None. Aggregated with :func:`token_mean` over ``global_token_count``
    (token-level normalisation across the global batch, not the per-sequence
    1/|o_i| of eq. 3), so summing the loss over micro-batches / ranks gives
    the global-batch loss.

    Args:
        logprobs: ``[batch, seq]`` current-policy log-probs (nats), requires grad.
        old_logprobs: ``[batch, seq]`` behaviour-policy log-probs (nats).
        ref_logprobs: ``[batch, seq]`` reference-policy log-probs, or None.
        advantages: ``[batch]`` (or ``[batch, seq]``) advantages.
        response_mask: ``[batch, seq]`` 1 on response tokens, 0 elsewhere.
        global_token_count: the global normaliser for ``cfg.loss_agg_mode`` (> 0): for
            "token-mean" the valid tokens of the whole global batch; for the seq-mean
            modes see :func:`alignment.algorithms.aggregation.aggregate`.
        cfg: :class:`GRPOLossConfig`.

    Returns:
        ``(loss, metrics)``: ``loss`` is a 0-d tensor; ``metrics`` holds
        detached 0-d SUMS over this micro-batch's valid tokens, to be
        all-reduced and divided by the global count by the caller:
        ``policy_loss_sum``, ``kl_sum`` (0 if skipped), ``clipped_tokens``,
        ``ratio_sum``, ``tokens``.

    Raises:
        ValueError: from the component functions (shapes, clip ratio,
            estimator name, non-positive count).
    """
    if response_mask.shape != logprobs.shape:
        raise ValueError(
            f"response_mask shape {tuple(response_mask.shape)} != logprobs shape "
            f"{tuple(logprobs.shape)}"
        )
    mask = response_mask.to(logprobs.dtype)
    high = cfg.clip_ratio if cfg.clip_ratio_high is None else cfg.clip_ratio_high
    pg_loss, is_clipped = ppo_policy_loss(logprobs, old_logprobs, advantages, cfg.clip_ratio, high)
    per_token = pg_loss
    use_kl = cfg.kl_coef != 0 and ref_logprobs is not None
    if use_kl:
        kl = kl_penalty(logprobs, ref_logprobs, cfg.kl_estimator)
        per_token = per_token + cfg.kl_coef * kl
        kl_sum = (kl.detach() * mask).sum()
    else:
        kl_sum = torch.zeros((), dtype=logprobs.dtype, device=logprobs.device)
    loss = aggregate(per_token, mask, cfg.loss_agg_mode, global_token_count)

    with torch.no_grad():
        ratio = torch.exp(logprobs.detach() - old_logprobs.detach())
        metrics = {
            "policy_loss_sum": (pg_loss.detach() * mask).sum(),
            "kl_sum": kl_sum,
            "clipped_tokens": (is_clipped.to(mask.dtype) * mask).sum(),
            "ratio_sum": (ratio * mask).sum(),
            "tokens": mask.sum(),
        }
    return loss, metrics
