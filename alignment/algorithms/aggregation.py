"""Loss aggregation over tokens with a globally fixed normaliser."""

from __future__ import annotations

from torch import Tensor

__all__ = ["token_mean"]


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
