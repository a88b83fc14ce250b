"""Direct preference optimisation objectives on (chosen, rejected) pairs.

``loss_type`` picks the loss from :mod:`alignment.algorithms.preference_loss`:
``sigmoid`` (DPO, with ``label_smoothing`` = cDPO), ``ipo``, ``hinge`` (SLiC) and ``kto``
use the frozen reference's sequence log-probs (``batch["ref_logps"]``, precomputed);
``simpo`` and ``orpo`` are reference-free. IPO uses length-averaged log-probs (as TRL). Rows are interleaved ``[chosen_0, rejected_0,
...]``; the loss is the mean over the pairs of the whole global batch.

Implicit reward reported for the held-out accuracy and margins: ``beta * (log pi - log
pi_ref)`` summed over the response (DPO family, KTO), ``beta * mean token log pi``
(SimPO), the log odds of the mean token probability (ORPO).
"""

from __future__ import annotations

import torch

from alignment.algorithms.preference_loss import dpo_loss, kto_loss, orpo_loss, simpo_loss
from alignment.trainers.megatron_step import LogprobOutputs

REFERENCE_FREE = ("simpo", "orpo")
LOSS_TYPES = ("sigmoid", "ipo", "hinge", "kto", "simpo", "orpo")


class DPOObjective:
    """Loss function for :mod:`alignment.trainers.offline` (two rows per pair).

    Args:
        beta: KL strength (DPO/IPO/hinge/KTO) or reward scale (SimPO).
        loss_type: one of :data:`LOSS_TYPES`.
        label_smoothing: cDPO flip probability (``sigmoid`` only).
        simpo_gamma: SimPO target margin; orpo_lambda: ORPO odds-ratio weight.
    Raises:
        ValueError: unknown ``loss_type``.
    """

    rows_per_example = 2
    value_head = False
    positions = "loss_mask"  # the output layer runs on the response positions only

    def __init__(self, vocab_size: int, beta: float, loss_type: str = "sigmoid", label_smoothing: float = 0.0,
                 simpo_gamma: float = 0.5, orpo_lambda: float = 0.1):
        if loss_type not in LOSS_TYPES:
            raise ValueError(f"algorithm.loss_type={loss_type!r}: valid values are {', '.join(LOSS_TYPES)}")
        self.vocab_size, self.beta, self.loss_type = vocab_size, beta, loss_type
        self.label_smoothing, self.simpo_gamma, self.orpo_lambda = label_smoothing, simpo_gamma, orpo_lambda
        self.needs_reference = loss_type not in REFERENCE_FREE
        self.outputs = LogprobOutputs(vocab_size)  # what forward_backward hands to loss()

    def normalizer(self, batch: dict[str, torch.Tensor]) -> float:
        """This rank's number of pairs."""
        return batch["input_ids"].shape[0] / 2

    def loss(self, mb, out, normalizer: float):
        """``(loss, metric sums)`` for one micro-batch; ``out["logprobs"]`` ``[mbs, seq]``."""
        mask = mb["loss_mask"]
        logps = (out["logprobs"] * mask).sum(1)  # [rows]
        lengths = mask.sum(1)
        c, r = slice(0, None, 2), slice(1, None, 2)
        t = self.loss_type
        if t in ("sigmoid", "ipo", "hinge"):
            pol, ref = logps, mb["ref_logps"]
            if t == "ipo":  # IPO on length-averaged log-probs, as TRL's DPOTrainer (stable with sums' scale)
                pol, ref = logps / lengths, ref / lengths
            losses, rc, rr = dpo_loss(pol[c], pol[r], ref[c], ref[r], self.beta, self.label_smoothing, t)
        elif t == "kto":
            # Paired data as KTO examples: chosen desirable, rejected undesirable. A pair's loss
            # is the MEAN of its two examples' (TRL's KTOTrainer: the mean over examples; a sum
            # would double the loss and its gradient). The KL reference point z0 is this
            # micro-batch's mean log-ratio of the matched examples (detached, >= 0); TRL and the
            # paper estimate it from mismatched (prompt, other completion) rows (not yet here).
            ratio = logps - mb["ref_logps"]
            z0 = ratio.detach().mean().clamp(min=0)
            desirable = torch.zeros_like(logps, dtype=torch.bool)
            desirable[c] = True
            per_row, rewards = kto_loss(logps, mb["ref_logps"], desirable, z0, self.beta)
            losses = (per_row[c] + per_row[r]) / 2
            rc, rr = rewards[c], rewards[r]
        elif t == "simpo":
            losses, rc, rr = simpo_loss(logps[c] / lengths[c], logps[r] / lengths[r], self.beta, self.simpo_gamma)
        else:  # orpo
            avg = logps / lengths
            losses, _ = orpo_loss(avg[c], avg[r], -avg[c], self.orpo_lambda)
            odds = (avg - torch.log(-torch.expm1(avg.clamp(max=-1e-6)))).detach()
            rc, rr = odds[c], odds[r]
        return losses.sum() / normalizer, {
            "loss_sum": losses.detach().sum(), "correct": (rc > rr).float().sum(), "margin_sum": (rc - rr).sum(),
            "chosen_sum": rc.sum(), "rejected_sum": rr.sum(), "count": torch.tensor(float(losses.numel())),
            "logps_chosen_sum": logps.detach()[c].sum()}

    @staticmethod
    def metrics(sums: dict[str, float]) -> dict[str, float]:
        """Implicit-reward accuracy (chosen strictly higher), mean margin, mean rewards and log-probs."""
        n = max(sums["count"], 1.0)
        return {"loss": sums["loss_sum"] / n, "accuracy": sums["correct"] / n, "margin": sums["margin_sum"] / n,
                "reward/chosen": sums["chosen_sum"] / n, "reward/rejected": sums["rejected_sum"] / n,
                "logps/chosen": sums["logps_chosen_sum"] / n}
