"""Process reward model loss: binary cross-entropy of a scalar head read at the end of every
reasoning step (Lightman et al. 2023, "Let's Verify Step by Step", Sec. 2.4: the PRM predicts
each step's correctness at the step's last token; Wang et al. 2024, Math-Shepherd, eq. 3)."""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["prm_loss", "place_step_labels"]


def place_step_labels(step_ends: list[list[int]], labels: list[list[int]], seq_len: int) -> tuple[Tensor, Tensor]:
    """Per-position targets ``[N, seq_len]``: row ``i`` holds ``labels[i][k]`` at position
    ``step_ends[i][k]`` (the position of the step's last token in the row's ids, where the head
    reads the step's score) and a mask of 1 there, 0 elsewhere.

    Raises:
        ValueError: lengths that differ, a label not 0/1, a position outside ``[0, seq_len)``, or
            the same position twice in a row.
    """
    if len(step_ends) != len(labels):
        raise ValueError(f"{len(step_ends)} rows of step ends for {len(labels)} rows of labels")
    target, mask = torch.zeros(len(labels), seq_len), torch.zeros(len(labels), seq_len)
    for i, (ends, ys) in enumerate(zip(step_ends, labels)):
        if len(ends) != len(ys):
            raise ValueError(f"row {i}: {len(ends)} step ends for {len(ys)} labels")
        if len(set(ends)) != len(ends):
            raise ValueError(f"row {i}: a position ends two steps: {ends}")
        for e, y in zip(ends, ys):
            if y not in (0, 1):
                raise ValueError(f"row {i}: step label {y!r} must be 0 or 1")
            if not 0 <= e < seq_len:
                raise ValueError(f"row {i}: step end {e} outside [0, {seq_len})")
            target[i, e], mask[i, e] = float(y), 1.0
    return target, mask


def prm_loss(values: Tensor, labels: Tensor, mask: Tensor, num_steps: float | Tensor) -> Tensor:
    """``sum(BCEWithLogits(values, labels) * mask) / num_steps``: the mean per-step loss over the
    global batch when ``num_steps`` is the global number of labelled steps (summing the result
    over micro-batches and data-parallel ranks gives the global mean).

    Args:
        values: ``[batch, seq]`` head outputs (logits of P(step correct)).
        labels: ``[batch, seq]`` 0/1 targets (read where ``mask`` is 1).
        mask: ``[batch, seq]`` 1 at step ends.
        num_steps: positive global count of labelled steps.
    Returns:
        0-d tensor (nats per step).
    Raises:
        ValueError: shapes differ or ``num_steps <= 0``.
    """
    if values.shape != labels.shape or values.shape != mask.shape:
        raise ValueError(f"values {tuple(values.shape)}, labels {tuple(labels.shape)}, mask {tuple(mask.shape)} differ")
    if float(num_steps) <= 0:
        raise ValueError(f"num_steps={float(num_steps)} must be > 0")
    per = torch.nn.functional.binary_cross_entropy_with_logits(values.float(), labels.float(), reduction="none")
    return (per * mask).sum() / num_steps
