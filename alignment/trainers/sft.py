"""Supervised fine-tuning objective: next-token NLL on response tokens only, token-mean
over the whole global batch (Megatron-LM / verl SFT convention)."""

from __future__ import annotations

import math

import torch

from alignment.algorithms.sft_loss import sft_loss
from alignment.config import JobConfig
from alignment.training.megatron_step import LogprobOutputs


class SFTObjective:
    """Loss function for :mod:`alignment.trainers.offline` (one row per example).

    Batches come from :func:`alignment.training.batching.make_sequence_batch`.
    """

    rows_per_example = 1
    needs_reference = False
    value_head = False
    positions = "loss_mask"  # the output layer runs on the response positions only

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.outputs = LogprobOutputs(vocab_size)  # what forward_backward hands to loss()

    def normalizer(self, batch: dict[str, torch.Tensor]) -> tuple[float]:
        """This rank's share of the global normaliser: ``(response tokens,)``."""
        return (float(batch["loss_mask"].sum()),)

    def loss(self, mb: dict[str, torch.Tensor], out: dict[str, torch.Tensor], normalizer: tuple[float]
             ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """``(loss, metric sums)`` for one micro-batch; ``out["logprobs"]`` ``[mbs, seq]``;
        ``normalizer``: the global ``(response tokens,)``."""
        lp = out["logprobs"]
        loss = sft_loss(lp, mb["loss_mask"], normalizer[0])
        return loss, {"nll_sum": -(lp.detach() * mb["loss_mask"]).sum(), "count": mb["loss_mask"].sum()}

    @staticmethod
    def metrics(sums: dict[str, float]) -> dict[str, float]:
        """Global metrics from summed ``nll_sum`` and ``count`` (tokens)."""
        nll = sums["nll_sum"] / max(sums["count"], 1.0)
        return {"loss": nll, "perplexity": math.exp(min(nll, 50.0))}


def objective(cfg: JobConfig, vocab_size: int) -> SFTObjective:  # noqa: ARG001 - the registry's signature
    """The loss function object of an ``algorithm.name=sft`` job."""
    return SFTObjective(vocab_size)
