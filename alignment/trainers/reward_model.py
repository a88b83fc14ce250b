"""Reward-model objective: Bradley-Terry on (chosen, rejected) pairs with a scalar head.

Rows are interleaved ``[chosen_0, rejected_0, chosen_1, ...]`` so every micro-batch of
even size holds whole pairs. The score of a sequence is the head's output at its last real
token (:func:`alignment.models.value_head.sequence_scores`), as in InstructGPT's RM and
HF ``LlamaForSequenceClassification``. The loss is the mean over the pairs of the whole
global batch.
"""

from __future__ import annotations

import torch

from alignment.algorithms.preference_loss import bradley_terry_loss
from alignment.config import JobConfig
from alignment.models.value_head import sequence_scores
from alignment.training.megatron_step import value_outputs


class RewardModelObjective:
    """Loss function for :mod:`alignment.trainers.offline` on a value-head model.

    Args:
        center_coef: weight of the reward-centering term ``(r_c + r_r)^2`` (Eisenstein et al. 2023).
    """

    rows_per_example = 2
    needs_reference = False
    value_head = True
    positions = None  # the scalar head at every position (the score is read at the last token)
    outputs = staticmethod(value_outputs)  # what forward_backward hands to loss()

    def __init__(self, center_coef: float = 0.0) -> None:
        self.center_coef = center_coef

    def normalizer(self, batch: dict[str, torch.Tensor]) -> tuple[float]:
        """This rank's share of the global normaliser: ``(pairs,)``."""
        return (batch["input_ids"].shape[0] / 2,)

    def loss(self, mb: dict[str, torch.Tensor], out: dict[str, torch.Tensor], normalizer: tuple[float]
             ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """``(loss, metric sums)``; ``out["values"]`` ``[mbs, seq]`` from the scalar head."""
        scores = sequence_scores(out["values"], mb["last_index"])
        chosen, rejected = scores[0::2], scores[1::2]
        losses, _ = bradley_terry_loss(chosen, rejected, center_coef=self.center_coef)
        c, r = chosen.detach(), rejected.detach()
        return losses.sum() / normalizer[0], {
            "loss_sum": losses.detach().sum(), "correct": (c > r).float().sum(), "margin_sum": (c - r).sum(),
            "chosen_sum": c.sum(), "rejected_sum": r.sum(), "count": torch.tensor(float(c.numel()))}

    @staticmethod
    def metrics(sums: dict[str, float]) -> dict[str, float]:
        """Pairwise accuracy (chosen scored strictly higher), mean margin and mean scores."""
        n = max(sums["count"], 1.0)
        return {"loss": sums["loss_sum"] / n, "accuracy": sums["correct"] / n, "margin": sums["margin_sum"] / n,
                "reward/chosen": sums["chosen_sum"] / n, "reward/rejected": sums["rejected_sum"] / n}


def objective(cfg: JobConfig, vocab_size: int) -> RewardModelObjective:  # noqa: ARG001 - the registry's signature
    """The loss function object of an ``algorithm.name=rm`` job (``algorithm.center_coef``)."""
    return RewardModelObjective(center_coef=cfg.algorithm.center_coef)
