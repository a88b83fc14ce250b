"""A policy loss of your own: the unclipped importance-weighted policy gradient (REINFORCE with the
behaviour policy's ratio, no trust region).

    algorithm.policy_loss=examples.custom_algorithm.losses:unclipped_surrogate

The contract (alignment/algorithms/hooks.py): ``fn(logprobs, old_logprobs, advantages, response_mask,
clip_ratio_low, clip_ratio_high) -> (per_token_loss, is_clipped)``, both ``[batch, seq]``; the job masks and
aggregates the loss (``algorithm.loss_agg_mode``) and adds the KL and entropy terms.
"""

from __future__ import annotations

import torch


def unclipped_surrogate(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                        response_mask: torch.Tensor, clip_ratio_low: float, clip_ratio_high: float):
    """``loss = -exp(logprobs - old_logprobs) * A`` per token; nothing clipped (the clip ratios are unused).
    ``logprobs`` / ``old_logprobs``: ``[batch, seq]`` nats; ``advantages``: ``[batch]`` or ``[batch, seq]``.
    Where the ratio stays inside the clip range this is PPO's loss (Schulman et al. 2017, eq. 7) exactly."""
    adv = advantages[:, None] if advantages.dim() == 1 else advantages
    ratio = torch.exp(logprobs - old_logprobs.detach())
    loss = -ratio * adv.detach()
    return loss, torch.zeros_like(loss, dtype=torch.bool)
