"""Training on fixed data (SFT, reward model, DPO family): one optimizer step per global
batch, with the objective (:mod:`.sft`, :mod:`.reward_model`, :mod:`.dpo`) supplying the
loss of a micro-batch and the global normaliser.

Every data-parallel rank takes a contiguous slice of the global batch; the loss of a
micro-batch is divided by the normaliser summed over all DP ranks, so the gradient is
the gradient of the global-batch loss for any micro-batch split and layout
(tested against single-process autograd in ``tests/dist/offline_invariance_worker.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, cast

import torch

from alignment.data.images import ImageInputs, attach_images
from alignment.trainers.models import Models
from alignment.training.batching import MicroBatching, cat_rows, make_sequence_batch
from alignment.training import grad_stats
from alignment.training.health import guarded_step
from alignment.training.megatron_step import LogprobOutputs, all_reduce_sum, forward_backward, global_sums
from alignment.training.router_stats import routing_metrics


def _ps() -> Any:
    from megatron.core import parallel_state as ps

    return ps


class Objective(Protocol):
    """What this module needs from an objective (:mod:`.sft`, :mod:`.reward_model`, :mod:`.dpo`, :mod:`.kto`,
    :mod:`.process_reward`); an optional ``prepare(models, batches, mb)`` runs before its losses."""

    @property
    def needs_reference(self) -> bool:
        """Whether the batches need the reference's log-probs (``ref_logps``)."""

    @property
    def positions(self) -> str | None:
        """``forward_backward``'s ``positions``."""

    @property
    def outputs(self) -> Callable[[torch.Tensor, torch.Tensor], dict[str, torch.Tensor]]:
        """What ``forward_backward`` hands to :meth:`loss`."""

    def normalizer(self, batch: dict[str, torch.Tensor]) -> tuple[float, ...]:
        """This rank's shares of the global normalisers."""

    def loss(self, mb: dict[str, torch.Tensor], out: dict[str, torch.Tensor], normalizer: Any
             ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """``(loss, metric sums)`` of a micro-batch; ``normalizer``: the global sums of :meth:`normalizer`'s."""

    def metrics(self, sums: dict[str, float]) -> dict[str, float]:
        """The global metrics of the summed metric sums."""


def sequence_logps(model: torch.nn.Module, batch: dict[str, torch.Tensor], mb: MicroBatching, vocab_size: int
                   ) -> torch.Tensor:
    """Forward-only summed response log-probs ``[N]`` of every row (the reference's for DPO);
    zeros on ranks that are not the last pipeline stage (they never read them)."""

    def collect(micro: dict[str, torch.Tensor], out: dict[str, torch.Tensor]
                ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return out["logprobs"].sum() * 0, {"logps": (out["logprobs"] * micro["loss_mask"]).sum(1)}

    parts = mb.split(batch)
    with torch.no_grad():
        out = forward_backward(model, parts, collect, outputs=LogprobOutputs(vocab_size), forward_only=True,
                               packing=mb.packing, positions="loss_mask")
    return cat_rows(out, "logps", parts) if out else torch.zeros(batch["input_ids"].shape[0])


def build_batch(rows: list[tuple[list[int], int]], pad_id: int, models: Models, objective: Objective,
                mb: MicroBatching, images: list[ImageInputs | None] | None = None) -> dict[str, torch.Tensor]:
    """Padded tensors for this rank's rows (with their images: ``images[i]`` row ``i``'s
    :class:`alignment.data.images.ImageInputs` or None, :func:`alignment.data.images.attach_images`),
    with the reference's log-probs when the objective needs them. ``mb.micro_batch_size`` counts ROWS
    here (examples x ``objective.rows_per_example``)."""
    batch = attach_images(make_sequence_batch(rows, pad_id), images or [None] * len(rows))
    if objective.needs_reference:
        vocab = models.bridge.dims.vocab_size
        batch["ref_logps"] = sequence_logps(cast(torch.nn.Module, models.reference), batch, mb, vocab)  # it has one
    return batch


def train_step(models: Models, objective: Objective, batch: dict[str, torch.Tensor], mb: MicroBatching
               ) -> dict[str, float]:
    """One optimizer step on this rank's slice of the global batch; returns global metrics
    (the objective's, plus ``grad_norm``). ``mb.micro_batch_size`` counts rows. The objective's
    ``normalizer`` (a tuple: its global normalisers) is summed over the data-parallel ranks;
    its optional ``prepare(models, batches, mb)`` runs first (KTO's reference point)."""
    ps = _ps()
    if hasattr(objective, "prepare"):
        objective.prepare(models, [batch], mb)
    normalizer = tuple(all_reduce_sum(list(objective.normalizer(batch)), ps.get_data_parallel_group()))
    models.policy.zero_grad_buffer()  # type: ignore[operator]  # Megatron DDP's method, unknown to torch.nn.Module
    models.optimizer.zero_grad()
    out = forward_backward(models.policy, mb.split(batch), lambda micro, o: objective.loss(micro, o, normalizer),
                           outputs=objective.outputs, forward_only=False, packing=mb.packing,
                           positions=objective.positions)
    applied, grad_norm = guarded_step(models.policy, models.optimizer, grad_stats.requested())
    metrics = objective.metrics(global_sums(out))
    metrics["grad_norm"] = grad_norm
    metrics["health/skipped_updates"] = float(not applied)  # NaN/inf gradients: alignment/training/health.py
    metrics.update(routing_metrics(models.policy))  # MoE: expert load imbalance, aux loss
    return metrics


@torch.no_grad()
def evaluate(models: Models, objective: Objective, batches: list[dict[str, torch.Tensor]], mb: MicroBatching
             ) -> dict[str, float]:
    """Global metrics of the objective over held-out ``batches`` (this rank's slices), no update
    (metrics come from the summed metric tensors, so the loss is left unnormalised)."""
    if hasattr(objective, "prepare"):
        objective.prepare(models, batches, mb)
    outs = []
    for batch in batches:
        ones = tuple(1.0 for _ in objective.normalizer(batch))
        outs += forward_backward(models.policy, mb.split(batch), lambda micro, o: objective.loss(micro, o, ones),
                                 outputs=objective.outputs, forward_only=True, packing=mb.packing,
                                 positions=objective.positions)
    return objective.metrics(global_sums(outs))
