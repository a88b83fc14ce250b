"""Policy-gradient objectives as per-token losses: the PPO clipped surrogate (symmetric,
clip-higher, dual-clip), GSPO's sequence-level ratio, CISPO's clipped importance weight, and
the entropy bonus. :func:`policy_loss` picks one by name (``algorithm.policy_loss``)."""

from __future__ import annotations

import torch
from torch import Tensor

from alignment.algorithms import hooks

__all__ = ["POLICY_LOSSES", "cispo_policy_loss", "clipped_surrogate_loss", "entropy_bonus", "gspo_policy_loss",
           "policy_loss", "ppo_policy_loss"]

POLICY_LOSSES = ("ppo", "gspo", "cispo")


def clipped_surrogate_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    clip_ratio: float,
) -> tuple[Tensor, Tensor]:
    """Per-token PPO clipped surrogate loss (to minimise).

    Schulman et al. 2017, "Proximal Policy Optimization Algorithms", eq. 7,
    negated::

        ratio   = exp(logprobs - old_logprobs)
        clipped = clamp(ratio, 1 - clip_ratio, 1 + clip_ratio)
        loss    = max(-ratio * A, -clipped * A)

    Gradient flows through ``logprobs`` only; ``old_logprobs`` and
    ``advantages`` are detached.

    Args:
        logprobs: ``[batch, seq]`` log-probs (nats) of the sampled tokens
            under the policy being optimised.
        old_logprobs: ``[batch, seq]`` log-probs (nats) under the policy that
            generated the samples.
        advantages: ``[batch]`` (broadcast over ``seq``) or ``[batch, seq]``.
        clip_ratio: epsilon of the trust region, > 0 (e.g. 0.2).

    Returns:
        ``(per_token_loss, is_clipped)``, both ``[batch, seq]``; ``is_clipped``
        is a bool tensor, True where the clipped branch is strictly the larger
        loss (i.e. the active, zero-gradient branch). No masking applied.

    Raises:
        ValueError: ``clip_ratio <= 0`` or shapes mismatch.
    """
    if clip_ratio <= 0:
        raise ValueError(f"clip_ratio must be > 0, got clip_ratio={clip_ratio}")
    # The symmetric special case of the clip-higher loss below.
    return ppo_policy_loss(logprobs, old_logprobs, advantages, clip_ratio, clip_ratio)


def _broadcast_advantages(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor) -> Tensor:
    """Validate shapes and return detached ``[batch, seq]`` advantages."""
    if logprobs.dim() != 2 or logprobs.shape != old_logprobs.shape:
        raise ValueError(
            f"logprobs {tuple(logprobs.shape)} and old_logprobs "
            f"{tuple(old_logprobs.shape)} must both be [batch, seq]"
        )
    if advantages.dim() == 1 and advantages.shape[0] == logprobs.shape[0]:
        adv = advantages.unsqueeze(1)
    elif advantages.shape == logprobs.shape:
        adv = advantages
    else:
        raise ValueError(
            f"advantages shape {tuple(advantages.shape)} must be [batch] or "
            f"[batch, seq] matching logprobs {tuple(logprobs.shape)}"
        )
    return adv.detach()


def ppo_policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    clip_ratio_low: float,
    clip_ratio_high: float,
    clip_ratio_c: float | None = None,
) -> tuple[Tensor, Tensor]:
    """Per-token PPO loss with asymmetric (clip-higher) and optional dual clip.

    Clip-higher: DAPO (Yu et al. 2025, "DAPO: An Open-Source LLM
    Reinforcement Learning System at Scale", eq. 10 / Sec. 3.1) decouples the
    lower and upper trust-region bounds. Dual clip: Ye et al. 2020,
    "Mastering Complex Control in MOBA Games with Deep Reinforcement
    Learning", eq. 5, bounds the loss of tokens with ``A < 0`` and a very
    large ratio. Same computation as verl ``core_algos.compute_policy_loss``
    (``clip_ratio_low``/``clip_ratio_high``/``clip_ratio_c``)::

        ratio   = exp(logprobs - old_logprobs)
        clipped = clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)
        ppo     = max(-ratio * A, -clipped * A)
        loss    = min(ppo, -clip_ratio_c * A)   where A < 0 (dual clip on)
                  ppo                           otherwise

    With ``clip_ratio_low == clip_ratio_high == eps`` and
    ``clip_ratio_c=None`` this equals :func:`clipped_surrogate_loss` with
    ``clip_ratio=eps`` exactly. Gradient flows through ``logprobs`` only.

    Args:
        logprobs: ``[batch, seq]`` log-probs (nats) under the current policy.
        old_logprobs: ``[batch, seq]`` log-probs (nats) under the behaviour
            policy.
        advantages: ``[batch]`` (broadcast over ``seq``) or ``[batch, seq]``.
        clip_ratio_low: lower epsilon, > 0 (ratio clipped at ``1 - low``).
        clip_ratio_high: upper epsilon, > 0 (ratio clipped at ``1 + high``;
            DAPO uses 0.28 with low 0.2).
        clip_ratio_c: dual-clip constant ``c > 1`` (Ye et al. use 3), or None
            to disable the dual clip.

    Returns:
        ``(per_token_loss, is_clipped)``, both ``[batch, seq]``;
        ``is_clipped`` (bool) is True where a constant (zero-gradient) clip
        branch is active: the PPO clipped term is strictly larger than the
        unclipped one, or (dual clip, ``A < 0``) ``-c * A`` is strictly smaller
        than the PPO term. No masking applied.

    Raises:
        ValueError: ``clip_ratio_low <= 0``, ``clip_ratio_high <= 0``,
            ``clip_ratio_c <= 1``, or shapes mismatch.
    """
    _check_clip(clip_ratio_low, clip_ratio_high)
    if clip_ratio_c is not None and not clip_ratio_c > 1.0:
        raise ValueError(
            f"clip_ratio_c must be > 1 (or None), got clip_ratio_c={clip_ratio_c}"
        )
    adv = _broadcast_advantages(logprobs, old_logprobs, advantages)
    ratio = torch.exp(logprobs - old_logprobs.detach())
    clipped = torch.clamp(ratio, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    loss_unclipped = -ratio * adv
    loss_clipped = -clipped * adv
    per_token_loss = torch.maximum(loss_unclipped, loss_clipped)
    is_clipped = loss_clipped > loss_unclipped
    if clip_ratio_c is not None:
        loss_dual = -clip_ratio_c * adv
        negative = adv < 0
        dual_active = negative & (loss_dual < per_token_loss)
        per_token_loss = torch.where(
            negative, torch.minimum(per_token_loss, loss_dual), per_token_loss
        )
        is_clipped = is_clipped | dual_active
    return per_token_loss, is_clipped


def _check_clip(clip_ratio_low: float, clip_ratio_high: float) -> None:
    if clip_ratio_low <= 0:
        raise ValueError(f"clip_ratio_low must be > 0, got clip_ratio_low={clip_ratio_low}")
    if clip_ratio_high <= 0:
        raise ValueError(f"clip_ratio_high must be > 0, got clip_ratio_high={clip_ratio_high}")


def gspo_policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    clip_ratio_low: float,
    clip_ratio_high: float,
) -> tuple[Tensor, Tensor]:
    """Per-token GSPO loss: the PPO clip applied to a length-normalised sequence ratio.

    Zheng et al. 2025, "Group Sequence Policy Optimization", eq. 5-7 and the GSPO-token form
    (eq. 13-14)::

        s_i     = exp( sum_t m_t (logprobs_t - old_logprobs_t) / |y_i| )    (|y_i| = sum_t m_t)
        r_i,t   = sg(s_i) * exp(logprobs_t - sg(logprobs_t))                 (value s_i)
        loss_t  = max(-r_i,t * A, -clamp(r_i,t, 1 - low, 1 + high) * A)

    Every valid token of a sequence has the same value and clip decision; the gradient of token
    ``t`` is ``s_i * A * grad logprobs_t`` where the clip is inactive, so a
    ``seq-mean-token-mean`` aggregation gives GSPO's ``(1/G) sum_i s_i A_i (1/|y_i|) grad log
    pi(y_i)``. The paper's clip ranges are small (``low`` 3e-4, ``high`` 4e-4): the ratio is a
    per-token geometric mean. A sequence with no valid token has ``s_i = 1``.

    Args:
        logprobs, old_logprobs: ``[batch, seq]`` log-probs (nats), current and old policy.
        advantages: ``[batch]`` or ``[batch, seq]`` (a per-token advantage is used per token).
        response_mask: ``[batch, seq]``, 1 on response tokens.
        clip_ratio_low, clip_ratio_high: the sequence ratio's trust region, each > 0.
    Returns:
        ``(per_token_loss, is_clipped)``, both ``[batch, seq]``, no masking applied.
    Raises:
        ValueError: a clip bound <= 0 or shapes that do not match.
    """
    _check_clip(clip_ratio_low, clip_ratio_high)
    adv = _broadcast_advantages(logprobs, old_logprobs, advantages)
    if response_mask.shape != logprobs.shape:
        raise ValueError(f"response_mask {tuple(response_mask.shape)} must match logprobs {tuple(logprobs.shape)}")
    mask = response_mask.to(logprobs.dtype)
    log_s = ((logprobs.detach() - old_logprobs.detach()) * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)
    ratio = torch.exp(log_s.unsqueeze(-1) + logprobs - logprobs.detach())
    clipped = torch.clamp(ratio, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    loss_unclipped, loss_clipped = -ratio * adv, -clipped * adv
    return torch.maximum(loss_unclipped, loss_clipped), loss_clipped > loss_unclipped


def cispo_policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    clip_ratio_low: float,
    clip_ratio_high: float,
) -> tuple[Tensor, Tensor]:
    """Per-token CISPO loss: REINFORCE weighted by the clipped, stop-gradient importance ratio.

    MiniMax-M1 (MiniMax 2025, "MiniMax-M1: Scaling Test-Time Compute Efficiently with Lightning
    Attention", Sec. 3.1, eq. 4-5), negated::

        w_t    = sg(clamp(exp(logprobs_t - old_logprobs_t), 1 - low, 1 + high))
        loss_t = -w_t * A * logprobs_t

    Unlike the PPO clip, no token loses its gradient: a clipped ratio only caps the weight
    (``-w_t * A * grad logprobs_t`` everywhere). The paper sets no lower bound (``low`` >= 1
    makes ``1 - low <= 0``) and tunes ``high``. The loss value is not a surrogate of the
    objective's value (it scales with ``logprobs``); its gradient is what matters.

    Args:
        logprobs, old_logprobs: ``[batch, seq]`` log-probs (nats), current and behaviour policy.
        advantages: ``[batch]`` or ``[batch, seq]``.
        clip_ratio_low, clip_ratio_high: the weight's bounds ``[1 - low, 1 + high]``, each > 0.
    Returns:
        ``(per_token_loss, is_clipped)``, both ``[batch, seq]``; ``is_clipped`` marks tokens
        whose weight was capped (they keep their gradient). No masking applied.
    Raises:
        ValueError: a clip bound <= 0 or shapes that do not match.
    """
    _check_clip(clip_ratio_low, clip_ratio_high)
    adv = _broadcast_advantages(logprobs, old_logprobs, advantages)
    ratio = torch.exp(logprobs.detach() - old_logprobs.detach())
    weight = torch.clamp(ratio, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    return -weight * adv * logprobs, weight != ratio


def policy_loss(
    name: str,
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    clip_ratio_low: float,
    clip_ratio_high: float,
    clip_ratio_c: float | None = None,
) -> tuple[Tensor, Tensor]:
    """The per-token policy loss ``name`` (``algorithm.policy_loss``): ``ppo``
    (:func:`ppo_policy_loss`, with the dual clip ``clip_ratio_c``), ``gspo``
    (:func:`gspo_policy_loss`), ``cispo`` (:func:`cispo_policy_loss`), or your own by import path
    (``module.path:function``, :mod:`alignment.algorithms.hooks`: called with ``logprobs, old_logprobs,
    advantages, response_mask, clip_ratio_low, clip_ratio_high``). Shapes and returns as theirs.

    Raises:
        ValueError: an unknown ``name``, ``clip_ratio_c`` with a loss other than ``ppo``, or
            the chosen loss's own errors.
    """
    if hooks.is_import_path(name):
        if clip_ratio_c is not None:
            raise ValueError(f"clip_ratio_c={clip_ratio_c} (dual clip) applies to the ppo loss only, not {name}")
        yours: tuple[torch.Tensor, torch.Tensor] = hooks.load(name, "algorithm.policy_loss")(
            logprobs, old_logprobs, advantages, response_mask, clip_ratio_low, clip_ratio_high)
        return yours
    if name not in POLICY_LOSSES:
        raise ValueError(f"policy loss {name!r}: valid values are {', '.join(POLICY_LOSSES)}")
    if name != "ppo" and clip_ratio_c is not None:
        raise ValueError(f"clip_ratio_c={clip_ratio_c} (dual clip) applies to the ppo loss only, not {name}")
    if name == "gspo":
        return gspo_policy_loss(logprobs, old_logprobs, advantages, response_mask, clip_ratio_low, clip_ratio_high)
    if name == "cispo":
        return cispo_policy_loss(logprobs, old_logprobs, advantages, clip_ratio_low, clip_ratio_high)
    return ppo_policy_loss(logprobs, old_logprobs, advantages, clip_ratio_low, clip_ratio_high, clip_ratio_c)


def entropy_bonus(entropy: Tensor, coef: float) -> Tensor:
    """Per-token entropy bonus as a loss term: ``-coef * entropy``.

    Adding this to the loss (to minimise) maximises the policy entropy, as in
    the ``- c2 * S[pi](s_t)`` term of Schulman et al. 2017, eq. 9 (verl
    ``entropy_coeff``). Aggregate it with the same mask / normaliser as the
    policy loss.

    Args:
        entropy: ``[batch, seq]`` per-token entropy (nats) of the policy's
            next-token distribution.
        coef: entropy coefficient, >= 0 (0 disables it).

    Returns:
        ``[batch, seq]`` tensor ``-coef * entropy``.

    Raises:
        ValueError: ``coef < 0`` or ``entropy`` is not 2-D.
    """
    if not coef >= 0:
        raise ValueError(f"coef must be >= 0, got coef={coef}")
    if entropy.dim() != 2:
        raise ValueError(f"entropy must be [batch, seq], got shape {tuple(entropy.shape)}")
    return -coef * entropy
