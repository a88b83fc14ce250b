"""Best-of-N selection: which of N sampled solutions to a problem to answer with, by majority vote
over the final answers (self-consistency, Wang et al. 2023) or by a reward model's score (an
outcome RM's score at the last token, or a process RM's step scores aggregated over the steps:
their product, Lightman et al. 2023 Sec. 3, or their minimum, Wang et al. 2024 Math-Shepherd)."""

from __future__ import annotations

import math
from collections import Counter

__all__ = ["AGGREGATIONS", "aggregate_steps", "pick_best", "majority_vote"]

AGGREGATIONS = ("prod", "min", "last")


def aggregate_steps(probs: list[float], how: str) -> float:
    """One solution's score from its steps' P(correct) ``probs`` (each in [0, 1]): their product
    (``prod``: the probability that every step is right), their minimum (``min``) or the last
    step's (``last``: an outcome RM's score). A solution without steps scores ``-inf``.

    Raises:
        ValueError: an unknown ``how``.
    """
    if how not in AGGREGATIONS:
        raise ValueError(f"aggregation {how!r}: valid values are {', '.join(AGGREGATIONS)}")
    if not probs:
        return -math.inf
    if how == "prod":
        return math.prod(probs)
    return min(probs) if how == "min" else probs[-1]


def pick_best(scores: list[float]) -> int:
    """Index of the highest score, the first one on ties.

    Raises:
        ValueError: no scores.
    """
    if not scores:
        raise ValueError("no solutions to pick from")
    return max(range(len(scores)), key=lambda i: (scores[i], -i))


def majority_vote(answers: list[str | None]) -> int:
    """Index of the first solution whose final answer is the most frequent one (ties: the answer
    that appears first); solutions without an answer (None) do not vote. All None: 0.

    Raises:
        ValueError: no answers.
    """
    if not answers:
        raise ValueError("no solutions to vote over")
    counts = Counter(a for a in answers if a is not None)
    if not counts:
        return 0
    top = max(counts.values())
    return next(i for i, a in enumerate(answers) if a is not None and counts[a] == top)
