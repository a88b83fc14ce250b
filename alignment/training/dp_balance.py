"""Re-deal a step's sequences over the data-parallel ranks so that each trains on nearly the
same number of tokens (verl's ``balance_batch``): every rank gathers the lengths and samples
of its DP group, and all compute the same Karmarkar-Karp partition
(:func:`parallel.balance.karmarkar_karp`, equal counts per rank)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from alignment.data.samples import Sample
from parallel.balance import karmarkar_karp


def balance_over_dp(samples: list[Sample], per_sample: list[torch.Tensor]) -> tuple[list[Sample], list[torch.Tensor]]:
    """This rank's new share of the DP group's samples, with their per-sample tensors.

    Args:
        samples: this rank's samples (the same count on every DP rank).
        per_sample: tensors ``[len(samples), ...]`` that travel with the samples (rewards, advantages).
    Returns:
        ``(samples, per_sample)`` for this rank: the same count as before, token counts
        (prompt + response) balanced over the DP ranks. Collective over the DP group.
    Raises:
        ValueError: DP ranks with different sample counts.
    """
    from megatron.core import parallel_state as ps

    group = ps.get_data_parallel_group()
    dp = group.size()
    if dp == 1:
        return samples, per_sample
    gathered = [None] * dp
    dist.all_gather_object(gathered, (samples, [t.tolist() for t in per_sample]), group=group)
    counts = {len(s) for s, _ in gathered}
    if len(counts) != 1:
        raise ValueError(f"balance_over_dp: data-parallel ranks hold different numbers of samples {sorted(counts)}")
    everyone = [s for part, _ in gathered for s in part]
    columns = [torch.tensor([v for _, ts in gathered for v in ts[j]], dtype=per_sample[j].dtype)
               for j in range(len(per_sample))]
    lengths = [len(s.prompt_ids) + len(s.response_ids) for s in everyone]
    mine = karmarkar_karp(lengths, dp, equal_size=True)[group.rank()]
    return [everyone[i] for i in mine], [c[mine] for c in columns]


def global_batch_share(lengths: list[int], dp: int, dp_rank: int, balance: bool) -> tuple[list[int], float]:
    """Which examples of a global batch data-parallel rank ``dp_rank`` trains on (SFT / RM / DPO).

    Args:
        lengths: token count of every example of the global batch (a pair: both sequences).
        dp, dp_rank: data-parallel size and this rank's index; ``len(lengths) % dp == 0``.
        balance: ``trainer.balance_batch``: this rank's Karmarkar-Karp part (equal counts,
            nearly equal tokens; :func:`parallel.balance.karmarkar_karp`) instead of the
            contiguous slice. Every rank computes the same partition: no communication.
    Returns:
        ``(positions, imbalance)``: sorted positions into ``lengths`` for this rank, and the
        largest rank's tokens over the mean rank's (1.0 = perfectly even).
    Raises:
        ValueError: ``len(lengths)`` not a multiple of ``dp``.
    """

    if len(lengths) % dp:
        raise ValueError(f"global_batch_share: {len(lengths)} examples cannot be split over {dp} data-parallel ranks")
    per = len(lengths) // dp
    parts = (karmarkar_karp(lengths, dp, equal_size=True) if balance
             else [list(range(r * per, (r + 1) * per)) for r in range(dp)])
    sums = [sum(lengths[i] for i in p) for p in parts]
    return sorted(parts[dp_rank]), max(sums) * dp / max(sum(sums), 1)
