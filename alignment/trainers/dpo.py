"""Direct preference optimisation objectives on (chosen, rejected) pairs.

``loss_type`` picks the loss from :mod:`alignment.algorithms.preference_loss`:
``sigmoid`` (DPO, with ``label_smoothing`` = cDPO), ``ipo``, ``hinge`` (SLiC) and ``kto``
use the frozen reference's sequence log-probs (``batch["ref_logps"]``, precomputed);
``simpo`` and ``orpo`` are reference-free. IPO uses length-averaged log-probs (as TRL). Rows
are interleaved ``[chosen_0, rejected_0, ...]``; the loss is the mean over the pairs of the
whole global batch, except ORPO's NLL term,
the mean over every chosen token of the global batch (TRL's ``ORPOTrainer``: token-level cross
entropy), and KTO, the mean over its examples (two per pair).

Implicit reward reported for the held-out accuracy and margins: ``beta * (log pi - log
pi_ref)`` summed over the response (DPO family, KTO), ``beta * mean token log pi``
(SimPO), the log odds of the mean token probability (ORPO).
"""

from __future__ import annotations

import torch

from alignment.algorithms.preference_loss import LOSS_TYPES, REFERENCE_FREE, dpo_loss, kto_loss, orpo_loss, simpo_loss
from alignment.config import JobConfig
from alignment.data.examples import is_unpaired
from alignment.trainers.kto import KTOObjective, kto_reference_point
from alignment.trainers.models import Models
from alignment.training.batching import MicroBatching
from alignment.training.megatron_step import LogprobOutputs


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
                 simpo_gamma: float = 0.5, orpo_lambda: float = 0.1) -> None:
        if loss_type not in LOSS_TYPES:
            raise ValueError(f"algorithm.loss_type={loss_type!r}: valid values are {', '.join(LOSS_TYPES)}")
        self.vocab_size, self.beta, self.loss_type = vocab_size, beta, loss_type
        self.label_smoothing, self.simpo_gamma, self.orpo_lambda = label_smoothing, simpo_gamma, orpo_lambda
        self.needs_reference = loss_type not in REFERENCE_FREE
        self.outputs = LogprobOutputs(vocab_size)  # what forward_backward hands to loss()
        self.kl_ref_point = 0.0  # KTO's z0 for the batches :meth:`prepare` saw last

    def normalizer(self, batch: dict[str, torch.Tensor]) -> tuple[float, float]:
        """This rank's shares of the global normalisers: ``(pairs, chosen response tokens)``."""
        return batch["input_ids"].shape[0] / 2, float(batch["loss_mask"][0::2].sum())

    def prepare(self, models: Models, batches: list[dict[str, torch.Tensor]], mb: MicroBatching) -> None:
        """KTO: the reference point ``z0`` of these batches (the step's, or all held-out ones)
        under the current policy, as TRL's ``KTOTrainer`` and the paper (Ethayarajh et al. 2024,
        sec. 4.1) estimate it: the mean of ``log pi(y'|x) - log pi_ref(y'|x)`` over mismatched
        rows (each prompt with another example's response, :func:`alignment.trainers.kto.mismatched_rows`), averaged
        over the data-parallel ranks, clamped at 0, no gradient. Other losses: nothing.
        Collective over the data-parallel group (every rank calls it)."""
        if self.loss_type == "kto":
            self.kl_ref_point = kto_reference_point(models, batches, mb, self.vocab_size, self.rows_per_example)

    def loss(self, mb: dict[str, torch.Tensor], out: dict[str, torch.Tensor], normalizer: tuple[float, float]
             ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """``(loss, metric sums)`` for one micro-batch; ``out["logprobs"]`` ``[mbs, seq]``;
        ``normalizer``: the global ``(pairs, chosen tokens)``."""
        pairs, chosen_tokens = normalizer
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
            # would double the loss and its gradient); z0 from mismatched rows (prepare()).
            desirable = torch.zeros_like(logps, dtype=torch.bool)
            desirable[c] = True
            per_row, rewards = kto_loss(logps, mb["ref_logps"], desirable, self.kl_ref_point, self.beta)
            losses = (per_row[c] + per_row[r]) / 2
            rc, rr = rewards[c], rewards[r]
        elif t == "simpo":
            losses, rc, rr = simpo_loss(logps[c] / lengths[c], logps[r] / lengths[r], self.beta, self.simpo_gamma)
        else:  # orpo: the odds-ratio term per pair; the NLL token-level over the global batch (TRL)
            avg = logps / lengths
            losses, _ = orpo_loss(avg[c], avg[r], torch.zeros_like(avg[c]), self.orpo_lambda)
            odds = (avg - torch.log(-torch.expm1(avg.clamp(max=-1e-6)))).detach()
            rc, rr = odds[c], odds[r]
            nll = -logps[c].sum()
            sums = self._sums(losses, rc, rr, logps[c])
            sums.update(nll_sum=nll.detach(), chosen_tokens=lengths[c].sum())
            return nll / chosen_tokens + losses.sum() / pairs, sums
        sums = self._sums(losses, rc, rr, logps[c])
        if t == "kto":
            sums["kl_sum"] = torch.tensor(self.kl_ref_point * losses.numel())
        return losses.sum() / pairs, sums

    @staticmethod
    def _sums(losses: torch.Tensor, rc: torch.Tensor, rr: torch.Tensor, logps_chosen: torch.Tensor
              ) -> dict[str, torch.Tensor]:
        return {"loss_sum": losses.detach().sum(), "correct": (rc > rr).float().sum(), "margin_sum": (rc - rr).sum(),
                "chosen_sum": rc.sum(), "rejected_sum": rr.sum(), "count": torch.tensor(float(losses.numel())),
                "logps_chosen_sum": logps_chosen.detach().sum()}

    @staticmethod
    def metrics(sums: dict[str, float]) -> dict[str, float]:
        """Implicit-reward accuracy (chosen strictly higher), mean margin, mean rewards and log-probs;
        ORPO's loss adds its token-level NLL (``nll``), KTO reports its reference point (``kl``)."""
        n = max(sums["count"], 1.0)
        out = {"loss": sums["loss_sum"] / n, "accuracy": sums["correct"] / n, "margin": sums["margin_sum"] / n,
               "reward/chosen": sums["chosen_sum"] / n, "reward/rejected": sums["rejected_sum"] / n,
               "logps/chosen": sums["logps_chosen_sum"] / n}
        if "nll_sum" in sums:
            out["nll"] = sums["nll_sum"] / max(sums["chosen_tokens"], 1.0)
            out["loss"] += out["nll"]
        if "kl_sum" in sums:
            out["kl"] = sums["kl_sum"] / n
        return out


def objective(cfg: JobConfig, vocab_size: int) -> DPOObjective | KTOObjective:
    """The loss function object of an ``algorithm.name=dpo`` job (:class:`DPOObjective`; KTO's on TRL's unpaired
    records, each with its label: :class:`alignment.trainers.kto.KTOObjective`)."""
    a = cfg.algorithm
    if a.loss_type == "kto" and is_unpaired(cfg.data, a):
        return KTOObjective(vocab_size, beta=a.beta)
    return DPOObjective(vocab_size, beta=a.beta, loss_type=a.loss_type, label_smoothing=a.label_smoothing,
                        simpo_gamma=a.simpo_gamma, orpo_lambda=a.orpo_lambda)
