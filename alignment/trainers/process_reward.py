"""Process-reward-model objective: a scalar head trained with binary cross-entropy at the end of
every labelled reasoning step (:mod:`alignment.algorithms.prm_loss`), one row per solution;
batches carry ``step_labels`` / ``step_mask`` ``[N, seq]`` (:func:`alignment.algorithms.prm_loss.
place_step_labels`). The loss is the mean over the labelled steps of the whole global batch."""

from __future__ import annotations

import torch

from alignment.algorithms.prm_loss import place_step_labels, prm_loss
from alignment.config import JobConfig
from alignment.training.megatron_step import value_outputs


class ProcessRewardObjective:
    """Loss function for :mod:`alignment.trainers.offline` on a value-head model (Lightman et al.
    2023): the head's logit at a step's last token predicts whether the step is correct."""

    rows_per_example = 1
    needs_reference = False
    value_head = True
    positions = None  # the scalar head at every position (read at the step ends)
    outputs = staticmethod(value_outputs)  # what forward_backward hands to loss()

    @staticmethod
    def add_targets(batch: dict[str, torch.Tensor], rows: list[tuple[list[int], int, list[int], list[int]]]) -> None:
        """``step_labels`` / ``step_mask`` ``[N, seq]`` for the batch of ``rows`` (``(ids,
        prompt_len, step_ends, labels)``, :func:`alignment.data.examples.tokenize_steps`)."""
        batch["step_labels"], batch["step_mask"] = place_step_labels(
            [r[2] for r in rows], [r[3] for r in rows], batch["input_ids"].shape[1])

    def normalizer(self, batch: dict[str, torch.Tensor]) -> tuple[float]:
        """This rank's share of the global normaliser: ``(labelled steps,)``."""
        return (float(batch["step_mask"].sum()),)

    def loss(self, mb: dict[str, torch.Tensor], out: dict[str, torch.Tensor], normalizer: tuple[float]
             ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """``(loss, metric sums)``; ``out["values"]`` ``[mbs, seq]`` from the scalar head."""
        values, labels, mask = out["values"], mb["step_labels"], mb["step_mask"]
        loss = prm_loss(values, labels, mask, normalizer[0])
        v = values.detach()
        correct = (((v > 0).float() == labels).float() * mask).sum()
        per_step = torch.nn.functional.binary_cross_entropy_with_logits(v.float(), labels.float(), reduction="none")
        return loss, {"loss_sum": (per_step * mask).sum(), "correct": correct, "count": mask.sum(),
                      "positive": (labels * mask).sum()}

    @staticmethod
    def metrics(sums: dict[str, float]) -> dict[str, float]:
        """Step-level BCE, accuracy (sigmoid > 0.5 == label) and the fraction of correct steps."""
        n = max(sums["count"], 1.0)
        return {"loss": sums["loss_sum"] / n, "step_accuracy": sums["correct"] / n,
                "positive_fraction": sums["positive"] / n}


def objective(cfg: JobConfig, vocab_size: int) -> ProcessRewardObjective:  # noqa: ARG001 - the registry's signature
    """The loss function object of an ``algorithm.name=prm`` job."""
    return ProcessRewardObjective()
