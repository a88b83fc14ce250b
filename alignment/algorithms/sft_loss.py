"""Supervised fine-tuning (negative log-likelihood) loss."""

from __future__ import annotations

from torch import Tensor

from alignment.algorithms.aggregation import token_mean

__all__ = ["sft_loss"]


def sft_loss(logprobs: Tensor, loss_mask: Tensor, global_token_count: float | Tensor) -> Tensor:
    """Token-level NLL: ``-sum(logprobs * loss_mask) / global_token_count``.

    Standard next-token cross-entropy restricted to the target (response)
    tokens; prompt and padding tokens are masked out by ``loss_mask``. As in
    :func:`alignment.algorithms.aggregation.token_mean`, the normaliser is the
    number of valid tokens of the WHOLE global batch (all micro-batches and
    data-parallel ranks), supplied by the caller, so summing the result over
    micro-batches / ranks gives the global token-mean NLL (cf. Megatron-LM
    / verl SFT trainer token-mean loss).

    Args:
        logprobs: ``[batch, seq]`` log-probs (nats) of the target tokens.
        loss_mask: ``[batch, seq]`` 1/True on target tokens, 0 on prompt and
            padding. Masked positions must hold finite values.
        global_token_count: positive scalar, ``loss_mask.sum()`` over the
            global batch.

    Returns:
        0-d tensor (nats per token).

    Raises:
        ValueError: shapes differ or ``global_token_count <= 0`` (from
            :func:`token_mean`).
    """
    return -token_mean(logprobs, loss_mask, global_token_count)
