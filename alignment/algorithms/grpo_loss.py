"""GRPO per-micro-batch loss: a policy loss (PPO clip, GSPO or CISPO), optionally corrected for
the rollout engine's policy, + KL to the reference policy."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import torch
from torch import Tensor

from alignment.algorithms.aggregation import aggregate
from alignment.algorithms.config import GRPOFamilyConfig, has_section
from alignment.algorithms.kl import kl_penalty
from alignment.algorithms.policy_loss import policy_loss
from alignment.algorithms.rollout_correction import RolloutCorrection, rollout_correction

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
    # alignment.algorithms.policy_loss.POLICY_LOSSES; the dual clip (ppo only; verl uses 3)
    policy_loss: str = "ppo"
    clip_ratio_c: float | None = None
    rollout_correction: RolloutCorrection | None = None

    @classmethod
    def from_algorithm(cls, a: Any) -> "GRPOLossConfig":
        """From a policy-gradient job's ``algorithm`` section
        (:class:`alignment.algorithms.config.PolicyGradientConfig`): its clipping, policy loss, KL weight and
        rollout correction; the KL estimator and the aggregation where the section has them (GRPO's step:
        :class:`alignment.algorithms.config.GRPOFamilyConfig`), this class's defaults otherwise."""
        corr = a.rollout_correction
        corr = None if corr is None else {f.name: getattr(corr, f.name) for f in fields(RolloutCorrection)}
        family = {"kl_estimator": a.kl_estimator, "loss_agg_mode": a.loss_agg_mode} \
            if has_section(a, GRPOFamilyConfig) else {}
        return cls(clip_ratio=a.clip_ratio, clip_ratio_high=a.clip_ratio_high, kl_coef=a.kl_coef,
                   policy_loss=a.policy_loss, clip_ratio_c=a.clip_ratio_c,
                   rollout_correction=RolloutCorrection(**corr) if corr is not None else None, **family)


def grpo_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    ref_logprobs: Tensor | None,
    advantages: Tensor,
    response_mask: Tensor,
    global_token_count: float | Tensor,
    cfg: GRPOLossConfig,
    rollout_logprobs: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """GRPO loss of one micro-batch (DeepSeekMath, Shao et al. 2024, eq. 3).

    Per token: ``w * policy_loss + kl_coef * kl_penalty(logprobs, ref)``, with the policy loss
    ``cfg.policy_loss`` (:func:`alignment.algorithms.policy_loss.policy_loss`) and ``w`` the
    rollout-correction weight (:mod:`alignment.algorithms.rollout_correction`; 1 when
    ``cfg.rollout_correction`` is off or ``rollout_logprobs`` is None). The KL term is skipped
    when ``cfg.kl_coef == 0`` or ``ref_logprobs`` is None. Aggregated by ``cfg.loss_agg_mode``
    over ``global_token_count`` (token-mean: normalised across the global batch, not the
    per-sequence 1/|o_i| of eq. 3), so summing the loss over micro-batches / ranks gives the
    global-batch loss.

    Args:
        logprobs: ``[batch, seq]`` current-policy log-probs (nats), requires grad.
        old_logprobs: ``[batch, seq]`` log-probs (nats) of the trainer's policy before this
            update (the proximal policy of the trust region).
        ref_logprobs: ``[batch, seq]`` reference-policy log-probs, or None.
        advantages: ``[batch]`` (or ``[batch, seq]``) advantages.
        response_mask: ``[batch, seq]`` 1 on response tokens, 0 elsewhere.
        global_token_count: the global normaliser for ``cfg.loss_agg_mode`` (> 0): for
            "token-mean" the valid tokens of the whole global batch; for the seq-mean
            modes see :func:`alignment.algorithms.aggregation.aggregate`.
        cfg: :class:`GRPOLossConfig`.
        rollout_logprobs: ``[batch, seq]`` the rollout engine's log-probs of the sampled tokens
            (the behaviour policy), or None.

    Returns:
        ``(loss, metrics)``: ``loss`` is a 0-d tensor; ``metrics`` holds
        detached 0-d SUMS over this micro-batch's valid tokens, to be
        all-reduced and divided by the global count by the caller:
        ``policy_loss_sum``, ``kl_sum`` (0 if skipped), ``clipped_tokens``,
        ``ratio_sum``, ``tokens``; with ``rollout_logprobs`` also the mismatch metrics of
        :func:`~alignment.algorithms.rollout_correction.rollout_correction` (``rollout_ratio_max``
        is a maximum, the others sums).

    Raises:
        ValueError: from the component functions (shapes, clip ratio, policy-loss or
            estimator name, non-positive count).
    """
    if response_mask.shape != logprobs.shape:
        raise ValueError(
            f"response_mask shape {tuple(response_mask.shape)} != logprobs shape "
            f"{tuple(logprobs.shape)}"
        )
    mask = response_mask.to(logprobs.dtype)
    high = cfg.clip_ratio if cfg.clip_ratio_high is None else cfg.clip_ratio_high
    pg_loss, is_clipped = policy_loss(cfg.policy_loss, logprobs, old_logprobs, advantages, response_mask,
                                      cfg.clip_ratio, high, cfg.clip_ratio_c)
    corr: dict[str, Tensor] = {}
    if rollout_logprobs is not None:
        correction = cfg.rollout_correction or RolloutCorrection()
        weights, corr = rollout_correction(old_logprobs, rollout_logprobs, response_mask, correction)
        if correction.enabled:
            pg_loss = pg_loss * weights
    per_token = pg_loss
    if cfg.kl_coef != 0 and ref_logprobs is not None:
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
            # k3 estimate of KL(old || current) per token (Schulman's approximator): PPO's early stop
            "approx_kl_sum": (((ratio - 1) - torch.log(ratio)) * mask).sum(),
            "tokens": mask.sum(),
            **corr,
        }
    return loss, metrics
