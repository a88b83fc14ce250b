"""Per-token sample estimators of KL(pi || pi_ref), KL coefficient
controllers, and the PPO-style KL-in-reward shaping."""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = [
    "KL_ESTIMATORS",
    "kl_penalty",
    "FixedKLController",
    "AdaptiveKLController",
    "kl_in_reward",
]

KL_ESTIMATORS: tuple[str, ...] = ("k1", "k2", "k3", "k3_clamped")


def kl_penalty(logprobs: Tensor, ref_logprobs: Tensor, estimator: str = "k3") -> Tensor:
    """Per-token estimate of KL(pi || pi_ref) from tokens sampled from pi.

    With ``log_ratio = logprobs - ref_logprobs`` (= log pi/pi_ref), following
    J. Schulman, "Approximating KL Divergence" (2020):

    * ``k1 = log_ratio`` (unbiased, high variance, can be negative)
    * ``k2 = 0.5 * log_ratio**2`` (biased, low variance, >= 0)
    * ``k3 = exp(-log_ratio) - 1 + log_ratio`` (unbiased, >= 0); this is the
      estimator used in DeepSeekMath GRPO eq. 4.
    * ``k3_clamped``: k3 with ``log_ratio`` clamped to ``[-20, 20]`` before
      the exp and the result clamped to ``[-10, 10]`` (so in ``[0, 10]``);
      verl's ``low_var_kl`` in ``kl_penalty`` (``core_algos.py``). Guards
      against exp overflow on tokens where pi_ref is far below pi.

    Args:
        logprobs: ``[batch, seq]`` log-probabilities (nats) of the sampled
            tokens under the current policy pi.
        ref_logprobs: ``[batch, seq]`` log-probabilities (nats) of the same
            tokens under the reference policy.
        estimator: one of ``KL_ESTIMATORS`` (``"k1"``, ``"k2"``, ``"k3"``,
            ``"k3_clamped"``).

    Returns:
        ``[batch, seq]`` per-token KL estimate in nats (no masking applied).

    Raises:
        ValueError: shapes differ, or ``estimator`` is not a valid name.
    """
    if logprobs.shape != ref_logprobs.shape:
        raise ValueError(
            f"logprobs shape {tuple(logprobs.shape)} != ref_logprobs shape "
            f"{tuple(ref_logprobs.shape)}"
        )
    log_ratio = logprobs - ref_logprobs
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio.square()
    if estimator == "k3":
        return torch.exp(-log_ratio) - 1.0 + log_ratio
    if estimator == "k3_clamped":
        lr = log_ratio.clamp(min=-20.0, max=20.0)
        return (torch.exp(-lr) - 1.0 + lr).clamp(min=-10.0, max=10.0)
    raise ValueError(f"unknown estimator={estimator!r}; valid values: {list(KL_ESTIMATORS)}")


def _check_n_steps(n_steps: int) -> None:
    if n_steps < 0:
        raise ValueError(f"n_steps must be >= 0, got n_steps={n_steps}")


class FixedKLController:
    """Constant KL coefficient (Ziegler et al. 2019, "Fine-Tuning Language
    Models from Human Preferences", Sec. 2.2, the non-adaptive case; verl's /
    TRL's ``FixedKLController``).

    Attributes:
        value: the current KL coefficient ``beta`` (unitless, multiplies nats).

    Raises:
        ValueError: ``kl_coef`` is negative or not finite.
    """

    def __init__(self, kl_coef: float) -> None:
        if not math.isfinite(kl_coef) or kl_coef < 0:
            raise ValueError(f"kl_coef must be finite and >= 0, got kl_coef={kl_coef}")
        self.value: float = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """No-op (the coefficient is fixed); arguments are accepted for API
        parity with :class:`AdaptiveKLController`.

        Raises:
            ValueError: ``n_steps`` is negative.
        """
        _check_n_steps(n_steps)


class AdaptiveKLController:
    """Adaptive KL coefficient with a proportional controller.

    Ziegler et al. 2019, "Fine-Tuning Language Models from Human
    Preferences", Sec. 2.2 (same update as verl's and TRL's
    ``AdaptiveKLController``)::

        e    = clip(KL_current / KL_target - 1, -0.2, 0.2)
        beta <- beta * (1 + e * n_steps / horizon)

    Args:
        init_kl_coef: initial ``beta`` (> 0; a zero coefficient could never
            adapt).
        target_kl: target per-sequence (or per-token, as the caller measures
            it) KL in nats, > 0.
        horizon: controller horizon in samples/steps (same unit as
            ``n_steps``), > 0.

    Attributes:
        value: the current KL coefficient ``beta``.

    Raises:
        ValueError: any argument is not finite and > 0.
    """

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: float) -> None:
        for name, val in (
            ("init_kl_coef", init_kl_coef),
            ("target_kl", target_kl),
            ("horizon", horizon),
        ):
            if not math.isfinite(val) or val <= 0:
                raise ValueError(f"{name} must be finite and > 0, got {name}={val}")
        self.value: float = float(init_kl_coef)
        self.target: float = float(target_kl)
        self.horizon: float = float(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        """Multiply ``value`` by ``1 + clip(current_kl/target - 1, ±0.2) *
        n_steps / horizon``.

        Args:
            current_kl: measured KL (nats) of the latest batch; may be
                negative (k1 estimator), the error is clipped anyway.
            n_steps: samples/steps since the last update (the batch size in
                verl/TRL), >= 0.

        Raises:
            ValueError: ``current_kl`` is not finite or ``n_steps`` is negative.
        """
        current_kl = float(current_kl)
        if not math.isfinite(current_kl):
            raise ValueError(f"current_kl must be finite, got current_kl={current_kl}")
        _check_n_steps(n_steps)
        proportional_error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        mult = 1.0 + proportional_error * n_steps / self.horizon
        self.value *= mult


def kl_in_reward(
    rewards: Tensor,
    logprobs: Tensor,
    ref_logprobs: Tensor,
    mask: Tensor,
    kl_coef: float,
    estimator: str = "k1",
) -> Tensor:
    """PPO-style per-token rewards with the KL penalty folded in.

    ``token_rewards[b, t] = -kl_coef * kl[b, t]`` at every valid token, and
    the sequence reward ``rewards[b]`` is added at the last valid token of
    row ``b``; 0 where ``mask == 0``. This is the reward of Ziegler et al.
    2019 Sec. 2.2 / Ouyang et al. 2022 eq. 2 distributed per token, as in
    verl's ``apply_kl_penalty`` + ``compute_reward`` and OpenRLHF's
    ``compute_reward`` (``kl`` from :func:`kl_penalty`).

    Args:
        rewards: ``[batch]`` sequence-level reward.
        logprobs: ``[batch, seq]`` log-probs (nats) of the sampled tokens
            under the rollout/old policy (normally detached).
        ref_logprobs: ``[batch, seq]`` log-probs under the reference policy.
        mask: ``[batch, seq]`` 1/True for valid response tokens.
        kl_coef: KL coefficient ``beta`` >= 0 (e.g. a controller's ``value``).
        estimator: name from ``KL_ESTIMATORS`` (default ``"k1"``, as verl).

    Returns:
        ``[batch, seq]`` per-token rewards (reward units).

    Raises:
        ValueError: ``rewards`` is not ``[batch]``, ``logprobs`` is not 2-D,
            ``ref_logprobs``/``mask`` shape differs from ``logprobs``, a row
            of ``mask`` has no valid token, ``kl_coef`` is negative or not
            finite, or ``estimator`` is unknown.
    """
    if logprobs.dim() != 2:
        raise ValueError(
            f"logprobs must be 2-D [batch, seq], got shape {tuple(logprobs.shape)}"
        )
    batch, seq = logprobs.shape
    if rewards.shape != (batch,):
        raise ValueError(
            f"rewards must be [batch]=({batch},), got shape {tuple(rewards.shape)}"
        )
    if mask.shape != logprobs.shape:
        raise ValueError(
            f"mask shape {tuple(mask.shape)} != logprobs shape {tuple(logprobs.shape)}"
        )
    if not math.isfinite(kl_coef) or kl_coef < 0:
        raise ValueError(f"kl_coef must be finite and >= 0, got kl_coef={kl_coef}")
    kl = kl_penalty(logprobs, ref_logprobs, estimator)  # checks shape + estimator
    valid = mask.bool()
    if not bool(valid.any(dim=1).all()):
        raise ValueError("mask has a row with no valid token; cannot place its reward")
    dtype = torch.promote_types(kl.dtype, rewards.dtype)
    zero = torch.zeros((), dtype=dtype, device=kl.device)
    token_rewards = torch.where(valid, -kl_coef * kl.to(dtype), zero)
    positions = torch.arange(seq, device=kl.device).expand(batch, seq)
    last = torch.where(valid, positions, -1).amax(dim=1)  # [batch]
    rows = torch.arange(batch, device=kl.device)
    token_rewards[rows, last] = token_rewards[rows, last] + rewards.to(dtype)
    return token_rewards
