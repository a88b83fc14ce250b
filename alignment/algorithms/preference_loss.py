"""Offline preference-optimisation and reward-model losses.

All inputs are per-sequence quantities of shape ``[batch]`` (one entry per
pair / example); all losses are returned per pair (``[batch]``, unreduced) so
the caller chooses the aggregation. Implicit rewards / metrics are returned
detached.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = [
    "DPO_LOSS_TYPES",
    "LOSS_TYPES",
    "REFERENCE_FREE",
    "bradley_terry_loss",
    "dpo_loss",
    "kto_loss",
    "orpo_loss",
    "simpo_loss",
]

DPO_LOSS_TYPES: tuple[str, ...] = ("sigmoid", "ipo", "hinge")
#: every preference loss a DPO-family job can train with (``algorithm.loss_type``)
LOSS_TYPES: tuple[str, ...] = (*DPO_LOSS_TYPES, "kto", "simpo", "orpo")
#: the losses that need no frozen reference policy
REFERENCE_FREE: tuple[str, ...] = ("simpo", "orpo")

_LOG2 = math.log(2.0)


def _check_same_1d(**tensors: Tensor) -> None:
    """Raise ValueError unless all tensors are 1-D with the same shape."""
    shapes = {name: tuple(x.shape) for name, x in tensors.items()}
    first = next(iter(shapes.values()))
    for name, shape in shapes.items():
        if len(shape) != 1 or shape != first:
            raise ValueError(
                f"{name} has shape {shape}; all of {list(shapes)} must be the same "
                f"[batch] shape, got {shapes}"
            )


def _check_positive(name: str, value: float) -> None:
    if not value > 0:
        raise ValueError(f"{name} must be > 0, got {name}={value}")


def _check_nonnegative(name: str, value: float) -> None:
    if not value >= 0:
        raise ValueError(f"{name} must be >= 0, got {name}={value}")


def dpo_loss(
    policy_chosen: Tensor,
    policy_rejected: Tensor,
    ref_chosen: Tensor,
    ref_rejected: Tensor,
    beta: float,
    label_smoothing: float = 0.0,
    loss_type: str = "sigmoid",
) -> tuple[Tensor, Tensor, Tensor]:
    """Direct Preference Optimisation loss and its variants, per pair.

    With ``h = (policy_chosen - ref_chosen) - (policy_rejected - ref_rejected)``
    (the difference of policy/reference log-ratios), as in TRL
    ``DPOTrainer.dpo_loss``:

    * ``"sigmoid"``: Rafailov et al. 2023, "Direct Preference Optimization",
      eq. 7: ``-logsigmoid(beta * h)``. With ``label_smoothing = eps``
      (conservative DPO, cDPO; Mitchell 2023): ``-(1 - eps) *
      logsigmoid(beta * h) - eps * logsigmoid(-beta * h)``. Equals ``log 2``
      when the policy equals the reference.
    * ``"ipo"``: Azar et al. 2023, "A General Theoretical Paradigm to
      Understand Learning from Human Preferences", eq. 17:
      ``(h - 1 / (2 * beta))**2``. (TRL feeds length-averaged log-probs for
      IPO; that choice is the caller's.)
    * ``"hinge"``: SLiC (Zhao et al. 2023): ``relu(1 - beta * h)``.

    Args:
        policy_chosen: ``[batch]`` summed log-probs (nats) of the chosen
            responses under the policy (requires grad).
        policy_rejected: ``[batch]`` same for the rejected responses.
        ref_chosen: ``[batch]`` chosen log-probs under the frozen reference.
        ref_rejected: ``[batch]`` rejected log-probs under the reference.
        beta: inverse temperature / KL strength, > 0.
        label_smoothing: probability that a label is flipped, in ``[0, 0.5)``;
            only for ``loss_type="sigmoid"``.
        loss_type: one of :data:`DPO_LOSS_TYPES`.

    Returns:
        ``(losses, chosen_rewards, rejected_rewards)``, each ``[batch]``; the
        implicit rewards ``beta * (policy - ref)`` are detached.

    Raises:
        ValueError: ``beta <= 0``, unknown ``loss_type``, ``label_smoothing``
            outside ``[0, 0.5)`` or non-zero for a non-sigmoid loss, or
            shapes mismatch.
    """
    _check_same_1d(
        policy_chosen=policy_chosen,
        policy_rejected=policy_rejected,
        ref_chosen=ref_chosen,
        ref_rejected=ref_rejected,
    )
    _check_positive("beta", beta)
    if loss_type not in DPO_LOSS_TYPES:
        raise ValueError(
            f"unknown loss_type={loss_type!r}; valid: {', '.join(DPO_LOSS_TYPES)}"
        )
    if not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"label_smoothing must be in [0, 0.5), got {label_smoothing}")
    if label_smoothing != 0.0 and loss_type != "sigmoid":
        raise ValueError(
            f"label_smoothing={label_smoothing} is only defined for loss_type='sigmoid', "
            f"got loss_type={loss_type!r}"
        )
    chosen_logratio = policy_chosen - ref_chosen.detach()
    rejected_logratio = policy_rejected - ref_rejected.detach()
    h = chosen_logratio - rejected_logratio
    if loss_type == "sigmoid":
        losses = -(1.0 - label_smoothing) * F.logsigmoid(beta * h)
        if label_smoothing != 0.0:
            losses = losses - label_smoothing * F.logsigmoid(-beta * h)
    elif loss_type == "ipo":
        losses = (h - 1.0 / (2.0 * beta)) ** 2
    else:  # hinge
        losses = torch.relu(1.0 - beta * h)
    chosen_rewards = beta * chosen_logratio.detach()
    rejected_rewards = beta * rejected_logratio.detach()
    return losses, chosen_rewards, rejected_rewards


def kto_loss(
    policy_logps: Tensor,
    ref_logps: Tensor,
    is_desirable: Tensor,
    kl_ref_point: float | Tensor,
    beta: float,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
) -> tuple[Tensor, Tensor]:
    """Kahneman-Tversky Optimisation loss, per example (unpaired data).

    Ethayarajh et al. 2024, "KTO: Model Alignment as Prospect Theoretic
    Optimization", eq. 8 (cf. TRL ``KTOTrainer.kto_loss``). With
    ``r = policy_logps - ref_logps`` and reference point ``z0``::

        desirable:   w_d * (1 - sigmoid(beta * (r - z0)))
        undesirable: w_u * (1 - sigmoid(beta * (z0 - r)))

    ``z0`` is treated as a constant (no gradient).

    Args:
        policy_logps: ``[batch]`` summed log-probs (nats) of each completion
            under the policy.
        ref_logps: ``[batch]`` same under the frozen reference.
        is_desirable: ``[batch]`` bool, True for desirable examples.
        kl_ref_point: ``z0 >= 0``, the batch estimate of KL(policy || ref),
            already clamped at 0 as in the paper (python number or 0-d tensor).
        beta: > 0.
        desirable_weight: ``w_d >= 0``.
        undesirable_weight: ``w_u >= 0``.

    Returns:
        ``(losses, rewards)``, both ``[batch]``; ``rewards = beta * r``
        (detached).

    Raises:
        ValueError: ``beta <= 0``, negative weights or ``kl_ref_point``,
            non-bool ``is_desirable``, or shapes mismatch.
    """
    _check_same_1d(policy_logps=policy_logps, ref_logps=ref_logps, is_desirable=is_desirable)
    if is_desirable.dtype != torch.bool:
        raise ValueError(f"is_desirable must be a bool tensor, got dtype {is_desirable.dtype}")
    _check_positive("beta", beta)
    _check_nonnegative("desirable_weight", desirable_weight)
    _check_nonnegative("undesirable_weight", undesirable_weight)
    if isinstance(kl_ref_point, Tensor):
        if kl_ref_point.numel() != 1:
            raise ValueError("kl_ref_point must be a scalar")
        kl_ref_point = kl_ref_point.detach()
    _check_nonnegative("kl_ref_point", float(kl_ref_point))
    logratio = policy_logps - ref_logps.detach()
    desirable = desirable_weight * (1.0 - torch.sigmoid(beta * (logratio - kl_ref_point)))
    undesirable = undesirable_weight * (1.0 - torch.sigmoid(beta * (kl_ref_point - logratio)))
    losses = torch.where(is_desirable, desirable, undesirable)
    return losses, beta * logratio.detach()


def simpo_loss(
    policy_chosen_avg: Tensor,
    policy_rejected_avg: Tensor,
    beta: float,
    gamma: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """Simple Preference Optimisation loss, per pair (reference-free).

    Meng et al. 2024, "SimPO: Simple Preference Optimization with a
    Reference-Free Reward", eq. 6::

        loss = -logsigmoid(beta * (c - r) - gamma)

    where ``c``/``r`` are LENGTH-NORMALISED log-probs (sum of token log-probs
    divided by the number of response tokens). TRL ``CPOTrainer``
    (``loss_type="simpo"``) writes the same as
    ``-logsigmoid(beta * ((c - r) - gamma / beta))``.

    Args:
        policy_chosen_avg: ``[batch]`` average per-token log-prob (nats) of
            the chosen responses under the policy.
        policy_rejected_avg: ``[batch]`` same for the rejected responses.
        beta: reward scale, > 0.
        gamma: target reward margin, >= 0.

    Returns:
        ``(losses, chosen_rewards, rejected_rewards)``, each ``[batch]``; the
        rewards ``beta * avg_logp`` are detached.

    Raises:
        ValueError: ``beta <= 0``, ``gamma < 0`` or shapes mismatch.
    """
    _check_same_1d(policy_chosen_avg=policy_chosen_avg, policy_rejected_avg=policy_rejected_avg)
    _check_positive("beta", beta)
    _check_nonnegative("gamma", gamma)
    losses = -F.logsigmoid(beta * (policy_chosen_avg - policy_rejected_avg) - gamma)
    return losses, beta * policy_chosen_avg.detach(), beta * policy_rejected_avg.detach()


def _log1mexp(x: Tensor) -> Tensor:
    """``log(1 - exp(x))`` for ``x < 0``, accurately (Maechler 2012).

    ``log(-expm1(x))`` for ``x > -log 2`` (where ``1 - exp(x)`` cancels) and
    ``log1p(-exp(x))`` otherwise. Each branch is evaluated on inputs that are
    safe for it so that ``torch.where`` never back-propagates NaN/inf.
    """
    near_zero = x > -_LOG2
    safe_a = torch.where(near_zero, x, torch.full_like(x, -1.0))
    safe_b = torch.where(near_zero, torch.full_like(x, -1.0), x)
    return torch.where(near_zero, torch.log(-torch.expm1(safe_a)), torch.log1p(-torch.exp(safe_b)))


def orpo_loss(
    chosen_avg_logps: Tensor,
    rejected_avg_logps: Tensor,
    nll_chosen: Tensor,
    lam: float,
) -> tuple[Tensor, Tensor]:
    """Odds-Ratio Preference Optimisation loss, per pair (reference-free).

    Hong et al. 2024, "ORPO: Monolithic Preference Optimization without
    Reference Model", eq. 6-7 (cf. TRL ``ORPOTrainer.odds_ratio_loss``). With
    ``p = exp(avg_logp)`` (geometric-mean token probability) and
    ``log_odds = log(p / (1 - p)) = avg_logp - log(1 - exp(avg_logp))``::

        loss = nll_chosen - lam * logsigmoid(log_odds_chosen - log_odds_rejected)

    Sign convention: both terms are to be MINIMISED; ``nll_chosen`` is the
    positive SFT negative log-likelihood of the chosen response and
    ``-logsigmoid(.) >= 0`` is ``L_OR`` of eq. 7, so ``loss >= nll_chosen``.
    (TRL's ``beta`` is ``lam`` here.)

    Numerics: ``log(1 - exp(x))`` is computed as ``log(-expm1(x))`` near 0
    and ``log1p(-exp(x))`` otherwise, so an average log-prob of ``-1e-12``
    (p almost 1) still gives an accurate log-odds; inputs are clamped to
    ``<= -tiny`` so ``avg_logp == 0`` (possible in low precision) gives a
    large finite log-odds instead of inf.

    Args:
        chosen_avg_logps: ``[batch]`` length-averaged log-probs (nats, <= 0)
            of the chosen responses under the policy.
        rejected_avg_logps: ``[batch]`` same for the rejected responses.
        nll_chosen: ``[batch]`` SFT NLL of the chosen responses (usually
            ``-chosen_avg_logps`` or its token-mean equivalent).
        lam: weight ``lambda >= 0`` of the odds-ratio term.

    Returns:
        ``(losses, log_odds_ratio)``, both ``[batch]``;
        ``log_odds_ratio = log_odds_chosen - log_odds_rejected`` (detached).

    Raises:
        ValueError: ``lam < 0``, any average log-prob > 0, or shapes mismatch.
    """
    _check_same_1d(
        chosen_avg_logps=chosen_avg_logps,
        rejected_avg_logps=rejected_avg_logps,
        nll_chosen=nll_chosen,
    )
    _check_nonnegative("lam", lam)
    for name, x in (
        ("chosen_avg_logps", chosen_avg_logps),
        ("rejected_avg_logps", rejected_avg_logps),
    ):
        if bool((x > 0).any()):
            raise ValueError(f"{name} must be <= 0 (log-probabilities), got max {float(x.max())}")
    tiny = torch.finfo(chosen_avg_logps.dtype).tiny
    c = torch.clamp(chosen_avg_logps, max=-tiny)
    r = torch.clamp(rejected_avg_logps, max=-tiny)
    log_odds_ratio = (c - _log1mexp(c)) - (r - _log1mexp(r))
    losses = nll_chosen - lam * F.logsigmoid(log_odds_ratio)
    return losses, log_odds_ratio.detach()


def bradley_terry_loss(
    reward_chosen: Tensor,
    reward_rejected: Tensor,
    margin: Tensor | None = None,
    center_coef: float = 0.0,
) -> tuple[Tensor, Tensor]:
    """Pairwise Bradley-Terry reward-model loss, per pair.

    Ouyang et al. 2022, "Training language models to follow instructions
    with human feedback", eq. 1: ``-logsigmoid(r_c - r_r)``; with a
    preference-strength margin ``m`` as in Touvron et al. 2023 (Llama 2),
    eq. 2: ``-logsigmoid(r_c - r_r - m)``; plus the reward-centering
    auxiliary term of Eisenstein et al. 2023 ("Helping or Herding?"),
    ``center_coef * (r_c + r_r)**2`` (cf. TRL ``RewardTrainer``
    ``center_rewards_coefficient``).

    Args:
        reward_chosen: ``[batch]`` scalar rewards of the chosen responses.
        reward_rejected: ``[batch]`` rewards of the rejected responses.
        margin: ``[batch]`` margins, or None for 0.
        center_coef: coefficient of the centering term, >= 0.

    Returns:
        ``(losses, accuracy)``: ``losses`` ``[batch]``; ``accuracy`` a
        detached 0-d tensor, the fraction of pairs with ``r_c > r_r``
        strictly (ties count as wrong; the margin is ignored).

    Raises:
        ValueError: ``center_coef < 0``, empty batch, or shapes mismatch.
    """
    if margin is None:
        _check_same_1d(reward_chosen=reward_chosen, reward_rejected=reward_rejected)
    else:
        _check_same_1d(reward_chosen=reward_chosen, reward_rejected=reward_rejected, margin=margin)
    if reward_chosen.numel() == 0:
        raise ValueError("reward_chosen must be non-empty")
    _check_nonnegative("center_coef", center_coef)
    diff = reward_chosen - reward_rejected
    if margin is not None:
        diff = diff - margin.detach()
    losses = -F.logsigmoid(diff)
    if center_coef != 0.0:
        losses = losses + center_coef * (reward_chosen + reward_rejected) ** 2
    with torch.no_grad():
        accuracy = (reward_chosen > reward_rejected).to(reward_chosen.dtype).mean()
    return losses, accuracy
