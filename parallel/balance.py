"""Balanced partitions of sequences by token count: across data-parallel ranks (every rank
gets the same number of tokens to train on) and into token-budget micro-batches.

Karmarkar-Karp's largest differencing method, k-way (Karmarkar & Karp 1982; the k-way form
of Korf 1998, as used by verl's ``get_seqlen_balanced_partitions``): start with one partial
partition per item (or per group of ``k`` items when every part must have the same count),
repeatedly merge the two partial partitions with the largest spread, pairing the heaviest
part of one with the lightest of the other.
"""

from __future__ import annotations

import heapq
import math


def karmarkar_karp(weights: list[int], k: int, equal_size: bool = False) -> list[list[int]]:
    """Partition item indices into ``k`` parts with nearly equal weight sums.

    Args:
        weights: non-negative weight (token count) per item.
        k: number of parts.
        equal_size: every part gets exactly ``len(weights) / k`` items.
    Returns:
        ``k`` sorted lists of indices (some empty when there are fewer items than parts).
    Raises:
        ValueError: ``k < 1``, or ``equal_size`` with ``len(weights)`` not a multiple of ``k``.
    """
    if k < 1:
        raise ValueError(f"karmarkar_karp: k={k} must be >= 1")
    n = len(weights)
    if equal_size and n % k:
        raise ValueError(f"karmarkar_karp: {n} items cannot be split into {k} parts of equal size")
    order = sorted(range(n), key=lambda i: (weights[i], i))
    heap, tie = [], 0
    groups = [order[g:g + k] for g in range(0, n, k)] if equal_size else [[i] for i in order]
    for items in groups:
        parts = [(weights[i], [i]) for i in items] + [(0, []) for _ in range(k - len(items))]
        parts.sort(key=lambda p: -p[0])
        heapq.heappush(heap, (-(parts[0][0] - parts[-1][0]), tie, parts))
        tie += 1
    while len(heap) > 1:
        _, _, a = heapq.heappop(heap)
        _, _, b = heapq.heappop(heap)
        merged = [(wa + wb, ia + ib) for (wa, ia), (wb, ib) in zip(a, reversed(b))]  # heaviest with lightest
        merged.sort(key=lambda p: -p[0])
        heapq.heappush(heap, (-(merged[0][0] - merged[-1][0]), tie, merged))
        tie += 1
    parts = heap[0][2] if heap else [(0, []) for _ in range(k)]
    return sorted((sorted(ix) for _, ix in parts), key=lambda ix: (ix[0] if ix else n, len(ix)))


def token_budget_partition(weights: list[int], max_tokens: int) -> list[list[int]]:
    """The fewest balanced parts whose weights each fit in ``max_tokens``.

    Args:
        weights: tokens per unit (a sequence, or a pair that must stay together).
        max_tokens: token budget of one part (``trainer.max_tokens_per_microbatch``).
    Returns:
        parts (sorted index lists, ordered by first index), at least ``ceil(sum / max_tokens)``.
    Raises:
        ValueError: a unit longer than the budget, or a budget < 1.
    """
    if max_tokens < 1:
        raise ValueError(f"trainer.max_tokens_per_microbatch={max_tokens}: must be >= 1")
    if weights and max(weights) > max_tokens:
        raise ValueError(f"trainer.max_tokens_per_microbatch={max_tokens} is smaller than a sequence of "
                         f"{max(weights)} tokens; raise it to at least {max(weights)}")
    k = max(1, math.ceil(sum(weights) / max_tokens))
    while True:
        parts = [p for p in karmarkar_karp(weights, k) if p]
        if all(sum(weights[i] for i in p) <= max_tokens for p in parts):
            return parts
        k += 1
