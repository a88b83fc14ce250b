"""Per-token sample estimators of KL(pi || pi_ref)."""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["KL_ESTIMATORS", "kl_penalty"]

KL_ESTIMATORS: tuple[str, ...] = ("k1", "k2", "k3")


def kl_penalty(logprobs: Tensor, ref_logprobs: Tensor, estimator: str = "k3") -> Tensor:
    """Per-token estimate of KL(pi || pi_ref) from tokens sampled from pi.

    With ``log_ratio = logprobs - ref_logprobs`` (= log pi/pi_ref), following
    J. Schulman, "Approximating KL Divergence" (2020):

    * ``k1 = log_ratio`` (unbiased, high variance, can be negative)
    * ``k2 = 0.5 * log_ratio**2`` (biased, low variance, >= 0)
    * ``k3 = exp(-log_ratio) - 1 + log_ratio`` (unbiased, >= 0); this is the
      estimator used in DeepSeekMath GRPO eq. 4.

    Args:
        logprobs: ``[batch, seq]`` log-probabilities (nats) of the sampled
            tokens under the current policy pi.
        ref_logprobs: ``[batch, seq]`` log-probabilities (nats) of the same
            tokens under the reference policy.
        estimator: one of ``"k1"``, ``"k2"``, ``"k3"``.

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
    raise ValueError(f"unknown estimator={estimator!r}; valid values: {list(KL_ESTIMATORS)}")
