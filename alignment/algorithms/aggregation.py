"""Loss aggregation over tokens with a globally fixed normaliser."""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = ["AGGREGATION_MODES", "aggregate", "token_mean"]

AGGREGATION_MODES: tuple[str, ...] = (
    "token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
)


def token_mean(values: Tensor, mask: Tensor, global_token_count: float | Tensor) -> Tensor:
    """``sum(values * mask) / global_token_count``.

    ``global_token_count`` is the number of valid tokens in the WHOLE global
    batch (all micro-batches, all data-parallel ranks), computed and passed
    by the caller; it is never derived from ``mask`` here. This makes the sum
    over micro-batches / ranks of the result equal the token mean of the
    global batch, so gradients do not depend on how the batch is split (the
    "token-level" loss of DAPO, Yu et al. 2025, Sec. 3.3; cf. verl
    ``agg_loss(loss_agg_mode="token-mean")`` with a global normaliser).

    Args:
        values: ``[batch, seq]`` per-token values (e.g. loss).
        mask: ``[batch, seq]`` 1/True for valid (response) tokens, 0 otherwise.
            Masked-out positions must still hold finite ``values``
            (``inf * 0`` is NaN).
        global_token_count: positive scalar (python number or 0-d tensor).

    Returns:
        0-d tensor, in the units of ``values``.

    Raises:
        ValueError: ``global_token_count <= 0`` or shapes differ.
    """
    if values.shape != mask.shape:
        raise ValueError(
            f"values shape {tuple(values.shape)} != mask shape {tuple(mask.shape)}"
        )
    if isinstance(global_token_count, Tensor):
        if global_token_count.numel() != 1:
            raise ValueError("global_token_count must be a scalar")
        if float(global_token_count) <= 0:
            raise ValueError(f"global_token_count must be > 0, got {float(global_token_count)}")
    elif global_token_count <= 0:
        raise ValueError(f"global_token_count must be > 0, got {global_token_count}")
    return (values * mask.to(values.dtype)).sum() / global_token_count


def aggregate(
    values: Tensor, mask: Tensor, mode: str, global_normalizer: float | Tensor
) -> Tensor:
    """Aggregate per-token ``values`` to a scalar, with a caller-given normaliser.

    Mode names follow verl ``core_algos.agg_loss(loss_agg_mode=...)``. The
    normaliser is NEVER derived from ``mask`` here: the caller computes it
    once over the WHOLE global batch (all micro-batches, all data-parallel
    ranks) and passes the same value to every call, so the sum of the results
    over micro-batches / ranks equals the global-batch aggregate for every
    mode (gradients independent of how the batch is split). What to pass:

    * ``"token-mean"``: ``sum(values * mask) / N``;
      ``N`` = number of valid tokens (``mask.sum()``) in the global batch.
      DAPO token-level loss (Yu et al. 2025, Sec. 3.3). Same as
      :func:`token_mean`.
    * ``"seq-mean-token-sum"``: ``sum_i sum_t(values * mask)[i] / N``;
      ``N`` = number of sequences in the global batch (count the rows with at
      least one valid token if padding rows exist).
    * ``"seq-mean-token-mean"``: ``sum_i mean_t(values | mask)[i] / N``, the
      per-sequence token mean of the original GRPO (Shao et al. 2024, eq. 3);
      ``N`` = number of sequences in the global batch, as above. A row with no
      valid token contributes 0.
    * ``"seq-mean-token-sum-norm"``: ``sum(values * mask) / N``, Dr. GRPO
      (Liu et al. 2025, "Understanding R1-Zero-Like Training", Sec. 3.1):
      a constant per-sequence length normaliser. The caller passes
      ``N = num_sequences_global * max_len`` where ``max_len`` is a constant
      (e.g. the configured maximum response length), not the batch's
      observed lengths.

    Args:
        values: ``[batch, seq]`` per-token values (e.g. loss); masked-out
            positions must hold finite values (``inf * 0`` is NaN).
        mask: ``[batch, seq]`` 1/True for valid tokens, 0/False otherwise.
        mode: one of :data:`AGGREGATION_MODES`.
        global_normalizer: positive finite scalar (python number or 0-d
            tensor), as described above.

    Returns:
        0-d tensor in the units of ``values``.

    Raises:
        ValueError: unknown ``mode`` (lists the valid ones), shapes differ or
            are not 2-D, or ``global_normalizer`` is not a positive finite
            scalar.
    """
    if mode not in AGGREGATION_MODES:
        raise ValueError(
            f"unknown mode={mode!r}; valid modes: {', '.join(AGGREGATION_MODES)}"
        )
    if values.dim() != 2 or values.shape != mask.shape:
        raise ValueError(
            f"values shape {tuple(values.shape)} and mask shape "
            f"{tuple(mask.shape)} must both be [batch, seq]"
        )
    if isinstance(global_normalizer, Tensor):
        if global_normalizer.numel() != 1:
            raise ValueError("global_normalizer must be a scalar")
        norm_value = float(global_normalizer)
    else:
        norm_value = float(global_normalizer)
    if not (math.isfinite(norm_value) and norm_value > 0):
        raise ValueError(f"global_normalizer must be finite and > 0, got {norm_value}")
    m = mask.to(values.dtype)
    masked = values * m
    if mode == "seq-mean-token-mean":
        row_tokens = torch.clamp(m.sum(dim=-1), min=1.0)
        return (masked.sum(dim=-1) / row_tokens).sum() / global_normalizer
    if mode == "seq-mean-token-sum":
        return masked.sum(dim=-1).sum() / global_normalizer
    # "token-mean" and "seq-mean-token-sum-norm" differ only in what the
    # caller passes as the normaliser.
    return masked.sum() / global_normalizer


def global_normalizer(mode: str, num_tokens: float, num_seqs: float, max_len: int) -> float:
    """The ``global_normalizer`` :func:`aggregate` expects for ``mode``, from global counts.

    Args:
        num_tokens: valid (response) tokens over the whole global batch (all micro-batches, DP ranks).
        num_seqs: sequences in the whole global batch.
        max_len: the generation budget (``max_tokens``), Dr.GRPO's constant length.
    Returns:
        ``num_tokens`` for "token-mean"; ``num_seqs`` for "seq-mean-token-sum" and
        "seq-mean-token-mean"; ``num_seqs * max_len`` for "seq-mean-token-sum-norm"
        (Liu et al. 2025, Dr.GRPO, Sec. 3.1; verl ``agg_loss``). At least 1.
    Raises:
        ValueError: unknown ``mode`` (lists the valid ones).
    """
    if mode == "token-mean":
        n = num_tokens
    elif mode in ("seq-mean-token-sum", "seq-mean-token-mean"):
        n = num_seqs
    elif mode == "seq-mean-token-sum-norm":
        n = num_seqs * max_len
    else:
        raise ValueError(f"loss_agg_mode={mode!r}: valid modes are {', '.join(AGGREGATION_MODES)}")
    return max(float(n), 1.0)
