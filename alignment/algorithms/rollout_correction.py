"""Rollout-training mismatch correction: importance weights from the rollout engine's policy to
the trainer's (``algorithm.rollout_correction``).

The engine that samples (vLLM, bf16, its own kernels; or an older policy version when rollouts
run ahead of training) is not exactly the policy the trainer differentiates. Decoupled PPO
(Hilton et al. 2021, "Batch size-invariance for policy optimization", Sec. 3) separates the
*behaviour* policy that produced the samples (``rollout_logprobs``) from the *proximal* policy of
the trust region (``old_logprobs``: the trainer's policy before this update) and weights each
token's PPO loss by ``pi_old / pi_rollout``. Yao et al. 2025 ("Your Efficient RL Framework
Secretly Brings You Off-Policy RL Training") truncate that weight at ``C`` (TIS) or drop the
tokens whose ratio leaves a band (masked IS, MIS); a sequence-level variant uses the product of
a sequence's token ratios. verl's ``rollout_corr`` and NeMo-RL's importance-sampling options
offer the same family; the choices made here:

- weights and masks are constants (no gradient), multiplied into the per-token policy loss only
  (the KL-to-reference term is not reweighted);
- a masked token or sequence contributes 0 and still counts in the loss normaliser, i.e. the
  masked estimator ``E_rollout[1{ratio in band} * grad]`` of Yao et al.; verl instead removes it
  from the denominator;
- ``geometric`` masks a sequence by the geometric mean of its token ratios
  (``exp(mean log ratio)``), which does not grow with length as the product does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["IS_LEVELS", "MASK_LEVELS", "RolloutCorrection", "rollout_correction"]

IS_LEVELS = ("token", "sequence")
MASK_LEVELS = ("token", "sequence", "geometric")
_LOG_RATIO_BOUND = 20.0  # exp(+-20): a sequence's summed log-ratio cannot overflow the weight


@dataclass
class RolloutCorrection:
    """``algorithm.rollout_correction``: truncated importance sampling and/or masking.

    ``is_level``: None (off), ``token`` (``w_t = min(r_t, is_threshold)``) or ``sequence``
    (``w = min(prod_t r_t, is_threshold)`` for every token of the sequence). ``mask_level``:
    None, ``token``, ``sequence`` or ``geometric``: zero the tokens (or whole sequences) whose
    ratio leaves ``[mask_low, mask_high]`` (``mask_low`` None: ``1 / mask_high``). Here
    ``r_t = pi_old(y_t) / pi_rollout(y_t)``."""

    is_level: str | None = None
    is_threshold: float = 2.0
    mask_level: str | None = None
    mask_low: float | None = None
    mask_high: float = 2.0

    def __post_init__(self) -> None:
        if self.is_level is not None and self.is_level not in IS_LEVELS:
            raise ValueError(f"is_level={self.is_level!r}: valid values are null, {', '.join(IS_LEVELS)}")
        if self.mask_level is not None and self.mask_level not in MASK_LEVELS:
            raise ValueError(f"mask_level={self.mask_level!r}: valid values are null, {', '.join(MASK_LEVELS)}")
        if not self.is_threshold > 0:
            raise ValueError(f"is_threshold={self.is_threshold}: must be > 0 (e.g. 2.0)")
        low = self.low
        if not 0 <= low < 1 < self.mask_high:
            raise ValueError(f"mask_low={self.mask_low} / mask_high={self.mask_high}: need 0 <= mask_low < 1 < "
                             f"mask_high (e.g. mask_high=2.0, mask_low=null for 0.5)")

    @property
    def low(self) -> float:
        """The lower mask bound (``1 / mask_high`` when ``mask_low`` is None)."""
        return 1.0 / self.mask_high if self.mask_low is None else self.mask_low

    @property
    def enabled(self) -> bool:
        return self.is_level is not None or self.mask_level is not None


def rollout_correction(old_logprobs: Tensor, rollout_logprobs: Tensor, response_mask: Tensor,
                       cfg: RolloutCorrection) -> tuple[Tensor, dict[str, Tensor]]:
    """Per-token weights for the policy loss and the mismatch metrics of one micro-batch.

    Args:
        old_logprobs: ``[batch, seq]`` the trainer's (proximal) policy log-probs (nats).
        rollout_logprobs: ``[batch, seq]`` the behaviour policy's, as the rollout engine returned them.
        response_mask: ``[batch, seq]``, 1 on response tokens.
        cfg: :class:`RolloutCorrection`.
    Returns:
        ``(weights, metrics)``. ``weights`` ``[batch, seq]`` (no gradient): 1 where no correction
        applies, the truncated ratio with ``is_level``, 0 on masked tokens and padding.
        ``metrics``, detached 0-d tensors over valid tokens, to be summed over micro-batches and
        ranks (``*_sum``, ``masked_tokens``) or max-reduced (``rollout_ratio_max``):
        ``rollout_kl_sum`` (k3 estimate of KL(pi_rollout || pi_old): ``r - 1 - log r`` per
        token, Schulman 2020), ``is_weight_sum``, ``is_weight_sq_sum`` (their squares: the
        weights' spread), ``masked_tokens``, ``rollout_ratio_max`` (the largest token ratio ``r_t``).
    Raises:
        ValueError: shapes that do not match.
    """
    if not old_logprobs.shape == rollout_logprobs.shape == response_mask.shape:
        raise ValueError(f"old_logprobs {tuple(old_logprobs.shape)}, rollout_logprobs "
                         f"{tuple(rollout_logprobs.shape)} and response_mask {tuple(response_mask.shape)} must all be "
                         f"[batch, seq]")
    with torch.no_grad():
        mask = response_mask.to(torch.float32)
        log_r = (old_logprobs.float() - rollout_logprobs.float()) * mask
        ratio = torch.exp(log_r.clamp(-_LOG_RATIO_BOUND, _LOG_RATIO_BOUND))
        lengths = mask.sum(-1, keepdim=True)
        log_seq = log_r.sum(-1, keepdim=True).clamp(-_LOG_RATIO_BOUND, _LOG_RATIO_BOUND)
        weights = mask.clone()
        if cfg.is_level == "token":
            weights = weights * ratio.clamp(max=cfg.is_threshold)
        elif cfg.is_level == "sequence":
            weights = weights * torch.exp(log_seq).clamp(max=cfg.is_threshold)
        if cfg.mask_level is not None:
            per = {"token": log_r, "sequence": log_seq.expand_as(log_r),
                   "geometric": (log_r.sum(-1, keepdim=True) / lengths.clamp(min=1.0)).expand_as(log_r)}
            r = torch.exp(per[cfg.mask_level].clamp(-_LOG_RATIO_BOUND, _LOG_RATIO_BOUND))
            weights = weights * ((r >= cfg.low) & (r <= cfg.mask_high)).float()
        valid = mask > 0
        masked = (valid & (weights == 0)).sum() if cfg.mask_level is not None else torch.zeros(())
        metrics = {
            "rollout_kl_sum": ((ratio - 1 - log_r) * mask).sum(),
            "is_weight_sum": (weights * mask).sum(),
            "is_weight_sq_sum": (weights.square() * mask).sum(),
            "masked_tokens": masked.float(),
            "rollout_ratio_max": ratio[valid].max() if valid.any() else torch.zeros(()),
        }
    return weights.to(old_logprobs.dtype), metrics
