"""Which sampled answers rejection-sampling fine-tuning keeps (STaR, Zelikman et al. 2022, Alg. 1:
keep the rationales whose answer is correct; RFT, Yuan et al. 2023, Sec. 3.2: and only the
distinct reasoning paths of each problem)."""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor

__all__ = ["accepted_indices"]


def accepted_indices(rewards: Tensor, group_size: int, threshold: float,
                     texts: Sequence[str] | None = None) -> list[list[int]]:
    """The samples to fine-tune on, per problem.

    Args:
        rewards: ``[num_problems * group_size]`` rewards, each problem's ``group_size`` samples
            contiguous.
        group_size: samples per problem (>= 1).
        threshold: a sample is accepted when its reward is ``>= threshold`` (1.0 with the 0/1
            grader: correct answers only).
        texts: the samples' response texts; given, only the first of identical responses to a
            problem is kept (RFT's distinct paths; compared after stripping whitespace).
    Returns:
        per problem, the flat indices (into ``rewards``) of its kept samples, in sampling order.
    Raises:
        ValueError: ``rewards`` is not 1-D or not a whole number of groups, or ``texts`` has
            another length.
    """
    if group_size < 1 or rewards.dim() != 1 or rewards.numel() % group_size:
        raise ValueError(f"rewards of shape {tuple(rewards.shape)} is not a whole number of groups of {group_size}")
    if texts is not None and len(texts) != rewards.numel():
        raise ValueError(f"{len(texts)} texts for {rewards.numel()} rewards")
    ok = (rewards >= threshold).tolist()
    out = []
    for start in range(0, rewards.numel(), group_size):
        kept, seen = [], set()
        for i in range(start, start + group_size):
            if not ok[i]:
                continue
            key = texts[i].strip() if texts is not None else i
            if key not in seen:
                seen.add(key)
                kept.append(i)
        out.append(kept)
    return out

