"""KTO on unpaired preference data (TRL's ``KTOTrainer``): each row is one completion to a prompt, labelled
desirable or undesirable, and its loss is :func:`alignment.algorithms.preference_loss.kto_loss`
(Ethayarajh et al. 2024, "KTO: Model Alignment as Prospect Theoretic Optimization", eq. 8) against the
frozen reference's log-probs, with the reference point ``z0`` estimated from mismatched rows (each prompt
with the previous row's completion), as TRL's ``KTOTrainer`` and the paper (sec. 4.1) estimate it. The loss
is the mean over the rows of the global batch (TRL: the mean over its examples).

Paired data with ``loss_type=kto`` trains in :mod:`alignment.trainers.dpo` (chosen desirable, rejected not).
"""

from __future__ import annotations

from typing import cast

import torch

from alignment.algorithms.preference_loss import kto_loss
from alignment.data.images import ImageInputs
from alignment.trainers.models import Models
from alignment.trainers.offline import sequence_logps
from alignment.training.batching import MicroBatching, make_sequence_batch
from alignment.training.megatron_step import LogprobOutputs, all_reduce_sum


class KTOObjective:
    """Loss function for :mod:`alignment.trainers.offline` (one row per example; ``batch["desirable"]`` ``[N]``
    bool from the rows' labels, :meth:`add_targets`).

    Args:
        vocab_size: the model's vocabulary (the log-probs' last dimension before the gather).
        beta: KTO's beta (> 0).
        desirable_weight, undesirable_weight: TRL's ``desirable_weight`` / ``undesirable_weight`` (>= 0).
    """

    rows_per_example = 1
    value_head = False
    needs_reference = True
    positions = "loss_mask"  # the output layer runs on the response positions only

    def __init__(self, vocab_size: int, beta: float, desirable_weight: float = 1.0, undesirable_weight: float = 1.0
                 ) -> None:
        self.vocab_size, self.beta = vocab_size, beta
        self.weights = (desirable_weight, undesirable_weight)
        self.outputs = LogprobOutputs(vocab_size)
        self.kl_ref_point = 0.0  # z0 for the batches prepare() saw last

    @staticmethod
    def add_targets(batch: dict[str, torch.Tensor], rows: list[tuple[list[int], int, ImageInputs | None, bool]]
                    ) -> None:
        """``batch["desirable"]`` ``[N]`` from the rows' labels (``(ids, prompt_len, images, label)``)."""
        batch["desirable"] = torch.tensor([bool(r[3]) for r in rows], dtype=torch.bool)

    @staticmethod
    def normalizer(batch: dict[str, torch.Tensor]) -> tuple[float]:
        """This rank's share of the global normaliser: its rows."""
        return (float(batch["input_ids"].shape[0]),)

    def prepare(self, models: Models, batches: list[dict[str, torch.Tensor]], mb: MicroBatching) -> None:
        """``z0`` of these batches (:func:`kto_reference_point`: each prompt with the
        previous row's completion). Collective over the data-parallel group."""
        self.kl_ref_point = kto_reference_point(models, batches, mb, self.vocab_size, 1)

    def loss(self, mb: dict[str, torch.Tensor], out: dict[str, torch.Tensor], normalizer: tuple[float]
             ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """``(loss, metric sums)`` for one micro-batch; ``out["logprobs"]`` ``[mbs, seq]``; ``normalizer``: the
        global rows."""
        [rows] = normalizer
        logps = (out["logprobs"] * mb["loss_mask"]).sum(1)  # [rows], summed over the completion
        desirable = mb["desirable"].to(logps.device)
        losses, rewards = kto_loss(logps, mb["ref_logps"].to(logps.device), desirable, self.kl_ref_point, self.beta,
                                   *self.weights)
        good = desirable.float()
        sums = {"loss_sum": losses.detach().sum(), "count": torch.tensor(float(losses.numel())),
                "desirable": good.sum(), "reward_desirable_sum": (rewards * good).sum(),
                "reward_undesirable_sum": (rewards * (1 - good)).sum(),
                "kl_sum": torch.tensor(self.kl_ref_point * losses.numel())}
        return losses.sum() / rows, sums

    @staticmethod
    def metrics(sums: dict[str, float]) -> dict[str, float]:
        """The mean loss, ``z0`` (``kl``), the mean implicit reward ``beta * (log pi - log pi_ref)`` of the
        desirable and the undesirable completions, and their difference (``margin``)."""
        n = max(sums["count"], 1.0)
        good, bad = sums["desirable"], sums["count"] - sums["desirable"]
        chosen = sums["reward_desirable_sum"] / max(good, 1.0)
        rejected = sums["reward_undesirable_sum"] / max(bad, 1.0)
        return {"loss": sums["loss_sum"] / n, "kl": sums["kl_sum"] / n, "reward/desirable": chosen,
                "reward/undesirable": rejected, "margin": chosen - rejected}


def kto_reference_point(models: Models, batches: list[dict[str, torch.Tensor]], mb: MicroBatching, vocab_size: int,
                        rows_per_example: int) -> float:
    """KTO's ``z0`` for ``batches`` (this rank's) under the current policy: the mean of ``log pi(y'|x) -
    log pi_ref(y'|x)`` over their mismatched rows (:func:`mismatched_rows`, ``rows_per_example`` rows an example),
    averaged over the data-parallel ranks, clamped at 0 (Ethayarajh et al. 2024, sec. 4.1; TRL's
    ``KTOTrainer``). No gradient; collective over the data-parallel group."""
    from megatron.core import parallel_state as ps

    rows = []
    for b in batches:
        for i in range(b["input_ids"].shape[0]):
            n, r = int(b["seq_lengths"][i]), int(b["response_lengths"][i])
            rows.append((b["input_ids"][i, :n].tolist(), n - r))
    tok = models.tokenizer
    kl = make_sequence_batch(mismatched_rows(rows, rows_per_example),
                             tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id)
    delta = sequence_logps(models.policy, kl, mb, vocab_size) - sequence_logps(
        cast(torch.nn.Module, models.reference), kl, mb, vocab_size)  # KTO's jobs have a reference
    group: torch.distributed.ProcessGroup = ps.get_data_parallel_group()
    [total] = all_reduce_sum([float(delta.mean())], group)
    return max(total / group.size(), 0.0)


def mismatched_rows(rows: list[tuple[list[int], int]], rows_per_example: int = 2,
                    max_length: int | None = None) -> list[tuple[list[int], int]]:
    """KTO's KL rows: row ``i``'s prompt followed by the response of row ``i - rows_per_example``
    (cyclic), as ``(ids, prompt_len)``. TRL's ``KTOTrainer`` pairs example ``i`` with completion
    ``i - 1`` of an unpaired batch; megalign's rows are pairs ``[chosen_0, rejected_0, ...]``, and
    shifting by one row would give a prompt its own pair's other response, so the shift is one
    pair (chosen after chosen, rejected after rejected). A response is cut so that the row is no
    longer than ``max_length`` (default: the longest input row), keeping at least one token.

    Raises:
        ValueError: fewer than two examples (no other example's response to take).
    """
    if len(rows) < 2 * rows_per_example:
        raise ValueError(f"KTO's reference point needs at least 2 examples per data-parallel rank "
                         f"(got {len(rows) // rows_per_example}): raise trainer.global_batch_size or data.heldout_size")
    limit = max_length or max(len(ids) for ids, _ in rows)
    out = []
    for i, (ids, p) in enumerate(rows):
        other, q = rows[i - rows_per_example]
        response = other[q:]
        out.append((ids[:p] + response[: max(1, limit - p)], p))
    return out
