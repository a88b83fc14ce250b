"""On-policy distillation's per-token terms: the student samples, a frozen teacher scores its tokens.

- ``reverse_kl``: the sampled-token estimate of KL(student || teacher), negated, is each token's
  advantage (:func:`reverse_kl_advantages`), trained with the policy-gradient loss; Agarwal et al.
  2024 (GKD, on-policy with the reverse KL) and Thinking Machines' on-policy distillation recipe (2025:
  per-token reverse KL as the reward, discount 0). Needs only the teacher's log-probability of each
  sampled token.
- ``jsd``: GKD's generalized Jensen-Shannon divergence between the two whole distributions at every
  response position (:func:`generalized_jsd`; Agarwal et al. 2024, eq. 1), minimised directly.
- ``forward_kl``: KL(teacher || student) over the whole distributions (:func:`generalized_jsd` at
  ``beta = 0``): classic knowledge distillation (Hinton et al. 2015) on the sequences trained on.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

#: ``algorithm.distill_loss`` values
DISTILL_LOSSES = ("reverse_kl", "jsd", "forward_kl")
#: the losses that compare whole distributions (the teacher's ``[.., V]`` log-probabilities, not one token's)
FULL_DISTRIBUTION = ("jsd", "forward_kl")


def jsd_beta(loss: str, beta: float) -> float:
    """The generalized JSD's ``beta`` for ``algorithm.distill_loss``: ``beta`` for ``jsd``, 0 for
    ``forward_kl`` (KL(teacher || student)).

    Raises:
        ValueError: ``loss`` not in :data:`FULL_DISTRIBUTION`.
    """
    if loss not in FULL_DISTRIBUTION:
        raise ValueError(f"distill_loss={loss!r}: a whole-distribution loss is one of {', '.join(FULL_DISTRIBUTION)}")
    return beta if loss == "jsd" else 0.0


def generalized_jsd(student_logprobs: Tensor, teacher_logprobs: Tensor, beta: float) -> Tensor:
    """GKD's generalized Jensen-Shannon divergence per position (Agarwal et al. 2024, eq. 1):
    ``beta * KL(T || M) + (1 - beta) * KL(S || M)`` with the mixture ``M = beta T + (1 - beta) S``;
    ``beta = 0`` is the forward KL(T || S), ``beta = 1`` the reverse KL(S || T) (the limits, taken
    exactly). The same quantity as TRL's ``GKDTrainer.generalized_jsd_loss`` before its reduction.

    Args:
        student_logprobs: ``[..., V]`` log-probabilities (nats) of the student's distribution (the
            gradient flows through them).
        teacher_logprobs: ``[..., V]`` the teacher's (no gradient needed).
        beta: in ``[0, 1]``.
    Returns:
        ``[...]`` the divergence at each position (nats, >= 0).
    Raises:
        ValueError: shapes that differ, or ``beta`` outside ``[0, 1]``.
    """
    if student_logprobs.shape != teacher_logprobs.shape:
        raise ValueError(f"student {tuple(student_logprobs.shape)} and teacher {tuple(teacher_logprobs.shape)} "
                         "log-probabilities must have one shape [..., V]")
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta={beta}: must be in [0, 1] (0: forward KL, 1: reverse KL)")
    s, t = student_logprobs, teacher_logprobs

    def kl(p: Tensor, q: Tensor) -> Tensor:  # KL(p || q) from (finite) log-probabilities
        return (p.exp() * (p - q)).sum(-1)

    if beta == 0.0:
        return kl(t, s)
    if beta == 1.0:
        return kl(s, t)
    m = torch.logaddexp(s + math.log1p(-beta), t + math.log(beta))
    return beta * kl(t, m) + (1.0 - beta) * kl(s, m)


def reverse_kl_advantages(teacher_logprobs: Tensor, student_logprobs: Tensor, response_mask: Tensor) -> Tensor:
    """Per-token advantages of on-policy distillation with the reverse KL: ``log pi_T(y_t) - log
    pi_S(y_t)`` at each sampled token ``y_t`` (the negated one-sample estimate of KL(student ||
    teacher) there), 0 off the response. As a per-token reward with discount 0, the policy gradient
    of it is the gradient of the sequence's reverse KL (Agarwal et al. 2024; Thinking Machines'
    on-policy distillation, 2025).

    Args:
        teacher_logprobs: ``[batch, seq]`` the teacher's log-probabilities (nats) of the sampled tokens.
        student_logprobs: ``[batch, seq]`` the sampling student's (e.g. ``old_logprobs``), no gradient.
        response_mask: ``[batch, seq]`` 1 on response tokens.
    Returns:
        ``[batch, seq]`` float advantages, detached.
    Raises:
        ValueError: shapes that differ.
    """
    if not teacher_logprobs.shape == student_logprobs.shape == response_mask.shape:
        raise ValueError(f"teacher {tuple(teacher_logprobs.shape)}, student {tuple(student_logprobs.shape)} and mask "
                         f"{tuple(response_mask.shape)} must have one shape [batch, seq]")
    return ((teacher_logprobs - student_logprobs) * response_mask).detach()
