"""PPO clipped surrogate objective, as a per-token loss."""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["clipped_surrogate_loss"]


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
    adv = adv.detach()
    ratio = torch.exp(logprobs - old_logprobs.detach())
    clipped = torch.clamp(ratio, 1.0 - clip_ratio, 1.0 + clip_ratio)
    loss_unclipped = -ratio * adv
    loss_clipped = -clipped * adv
    per_token_loss = torch.maximum(loss_unclipped, loss_clipped)
    is_clipped = loss_clipped > loss_unclipped
    return per_token_loss, is_clipped
