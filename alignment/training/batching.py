"""Turn rollouts into padded training tensors and micro-batches.

Alignment convention (shared with :class:`alignment.training.megatron_step.LogprobOutputs`):
position ``t`` of every ``[batch, seq]`` tensor refers to predicting token ``t + 1``.
So ``response_mask[i, t] = 1`` exactly when ``input_ids[i, t + 1]`` is a response token,
and ``rollout_logprobs[i, t]`` is the engine's logprob of that token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from alignment.data.images import attach_images, select_rows
from alignment.data.samples import Sample
from parallel.balance import token_budget_partition


def make_batch(samples: list[Sample], pad_id: int, pad_to_multiple: int = 8) -> dict[str, torch.Tensor]:
    """Right-padded tensors for ``N`` samples.

    Returns ``input_ids``, ``position_ids``, ``response_mask`` (float: 1 on the tokens the model
    generated, so 0 on an episode's tool outputs, ``Sample.loss_mask``), ``rollout_logprobs``:
    all ``[N, S]`` with ``S`` the longest prompt+response rounded up to ``pad_to_multiple``;
    ``response_lengths`` and ``seq_lengths`` (prompt + response) ``[N]``; when every sample carries
    ``routed_experts`` (a MoE policy's rollout routing), ``routed_experts`` ``[N, S, layers, k]`` int16,
    -1 on padding; when samples show images (``Sample.images``), the rows' images
    (:func:`alignment.data.images.attach_images`). Raises ValueError for an empty list.
    """
    if not samples:
        raise ValueError("make_batch needs at least one sample")
    longest = max(len(s.prompt_ids) + len(s.response_ids) for s in samples)
    seq = -(-longest // pad_to_multiple) * pad_to_multiple
    n = len(samples)
    input_ids = torch.full((n, seq), pad_id, dtype=torch.long)
    mask = torch.zeros(n, seq)
    rollout_lp = torch.zeros(n, seq)
    for i, s in enumerate(samples):
        p, r = len(s.prompt_ids), len(s.response_ids)
        input_ids[i, : p + r] = torch.tensor(s.prompt_ids + s.response_ids)
        mask[i, p - 1 : p + r - 1] = 1.0 if s.loss_mask is None else torch.tensor(s.loss_mask, dtype=torch.float32)
        rollout_lp[i, p - 1 : p + r - 1] = torch.tensor(s.logprobs, dtype=torch.float32)
    batch = {
        "input_ids": input_ids,
        "position_ids": torch.arange(seq).expand(n, seq).contiguous(),
        "response_mask": mask,
        "rollout_logprobs": rollout_lp,
        "response_lengths": torch.tensor([len(s.response_ids) for s in samples]),
        "seq_lengths": torch.tensor([len(s.prompt_ids) + len(s.response_ids) for s in samples]),
    }
    if all(s.routed_experts is not None for s in samples):
        first = samples[0].routed_experts
        routed = torch.full((n, seq, *first.shape[1:]), -1, dtype=torch.int16)
        for i, s in enumerate(samples):
            routed[i, : s.routed_experts.shape[0]] = s.routed_experts
        batch["routed_experts"] = routed
    return attach_images(batch, [s.images for s in samples])


def split_microbatches(batch: dict[str, torch.Tensor], micro_batch_size: int, max_tokens: int = 0,
                       rows_per_unit: int = 1) -> list[dict[str, torch.Tensor]]:
    """Split every ``[N, ...]`` tensor of ``batch`` into micro-batches.

    ``max_tokens = 0``: consecutive chunks of ``micro_batch_size`` rows (the last may be
    smaller). ``max_tokens > 0`` (``trainer.max_tokens_per_microbatch``): the fewest
    micro-batches whose real tokens (``batch["seq_lengths"]``) fit the budget, balanced by
    Karmarkar-Karp (:func:`parallel.balance.token_budget_partition`); ``rows_per_unit``
    consecutive rows stay together in order (2 for DPO's chosen/rejected pairs).
    Each micro-batch carries ``row_index`` ``[m]``: its rows' positions in ``batch``
    (:func:`cat_rows` puts outputs back in batch order), and its rows' images
    (:func:`alignment.data.images.select_rows`).
    Raises ValueError for ``micro_batch_size < 1`` or a unit longer than ``max_tokens``.
    """
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size={micro_batch_size}: must be >= 1")
    n = batch["input_ids"].shape[0]
    if max_tokens > 0:

        per_unit = batch["seq_lengths"].view(-1, rows_per_unit).sum(1).tolist()
        parts = [torch.tensor([u * rows_per_unit + j for u in p for j in range(rows_per_unit)])
                 for p in token_budget_partition(per_unit, max_tokens)]
    else:
        parts = [torch.arange(i, min(i + micro_batch_size, n)) for i in range(0, n, micro_batch_size)]
    return [{**select_rows(batch, idx), "row_index": idx} for idx in parts]


def cat_rows(outputs: list[dict[str, torch.Tensor]], key: str, microbatches: list[dict]) -> torch.Tensor:
    """Concatenate ``outputs[i][key]`` (one per micro-batch, rows first) in the order of the
    batch the micro-batches were split from (their ``row_index``), on the host: batches live on
    the CPU and ``forward_backward`` moves each micro-batch to the model's device."""
    values = torch.cat([o[key] for o in outputs])
    order = torch.cat([mb["row_index"] for mb in microbatches]).to(values.device)
    return values.index_select(0, torch.argsort(order)).cpu()


def make_sequence_batch(rows: list[tuple[list[int], int]], pad_id: int,
                        pad_to_multiple: int = 8) -> dict[str, torch.Tensor]:
    """Right-padded tensors for tokenised ``(ids, prompt_len)`` rows (SFT, reward model, DPO).

    Returns ``input_ids``, ``position_ids`` and ``loss_mask`` ``[N, S]`` (same convention
    as :func:`make_batch`: ``loss_mask[i, t] = 1`` when ``input_ids[i, t + 1]`` is a
    response token), ``last_index`` ``[N]`` (position of each row's last real token, where
    a reward model reads its score), ``response_lengths`` and ``seq_lengths`` ``[N]``.
    Raises ValueError for an empty list or a row without response tokens.
    """
    if not rows:
        raise ValueError("make_sequence_batch needs at least one row")
    seq = -(-max(len(ids) for ids, _ in rows) // pad_to_multiple) * pad_to_multiple
    n = len(rows)
    input_ids = torch.full((n, seq), pad_id, dtype=torch.long)
    mask = torch.zeros(n, seq)
    for i, (ids, p) in enumerate(rows):
        if not 0 < p < len(ids):
            raise ValueError(f"row {i}: prompt_len={p} must be in [1, {len(ids) - 1}] (a response is needed)")
        input_ids[i, : len(ids)] = torch.tensor(ids)
        mask[i, p - 1 : len(ids) - 1] = 1.0
    return {
        "input_ids": input_ids,
        "position_ids": torch.arange(seq).expand(n, seq).contiguous(),
        "loss_mask": mask,
        "last_index": torch.tensor([len(ids) - 1 for ids, _ in rows]),
        "response_lengths": torch.tensor([len(ids) - p for ids, p in rows]),
        "seq_lengths": torch.tensor([len(ids) for ids, _ in rows]),
    }


@dataclass(frozen=True)
class MicroBatching:
    """How a batch of rows becomes micro-batches: ``micro_batch_size`` rows each, or at most
    ``max_tokens`` real tokens each (``trainer.max_tokens_per_microbatch``; ``rows_per_unit``
    consecutive rows stay together), and whether the model sees them packed
    (``trainer.sequence_packing``)."""

    micro_batch_size: int
    max_tokens: int = 0
    rows_per_unit: int = 1
    packing: bool = False

    @classmethod
    def from_trainer(cls, trainer, rows_per_unit: int = 1) -> "MicroBatching":
        """From the ``trainer`` config: ``micro_batch_size`` counts units of ``rows_per_unit`` rows."""
        return cls(trainer.micro_batch_size * rows_per_unit, trainer.max_tokens_per_microbatch, rows_per_unit,
                   trainer.sequence_packing)

    def split(self, batch: dict) -> list[dict]:
        """:func:`split_microbatches` with these settings."""
        return split_microbatches(batch, self.micro_batch_size, self.max_tokens, self.rows_per_unit)
