"""Preference pairs from scored samples, for online / iterative DPO: per prompt, the best and the
worst of its ``n`` sampled responses (Xu et al. 2023, "Some things are more CRINGE than others",
Sec. 3: iterative DPO on the highest- vs lowest-scored of the policy's own samples; Yuan et al.
2024, "Self-Rewarding Language Models", Sec. 2.3: the same selection with ties dropped;
Guo et al. 2024, "Direct Language Model Alignment from Online AI Feedback")."""

from __future__ import annotations

from torch import Tensor

__all__ = ["best_worst_pairs"]


def best_worst_pairs(rewards: Tensor, group_size: int) -> list[tuple[int, int] | None]:
    """For each prompt, ``(chosen, rejected)``: flat indices of its highest- and lowest-rewarded
    samples, each the first in sampling order among equals; ``None`` when all its rewards are
    equal (a tie carries no preference).

    Args:
        rewards: ``[num_prompts * group_size]`` rewards, each prompt's samples contiguous.
        group_size: samples per prompt, >= 2.
    Returns:
        one entry per prompt.
    Raises:
        ValueError: ``group_size`` < 2, or ``rewards`` not 1-D or not a whole number of groups.
    """
    if group_size < 2:
        raise ValueError(f"rollout.group_size={group_size}: a preference pair needs >= 2 samples per prompt")
    if rewards.dim() != 1 or rewards.numel() % group_size:
        raise ValueError(f"rewards of shape {tuple(rewards.shape)} is not a whole number of groups of {group_size}")
    out = []
    for start in range(0, rewards.numel(), group_size):
        g = rewards[start:start + group_size].tolist()
        hi, lo = max(g), min(g)
        out.append(None if hi == lo else (start + g.index(hi), start + g.index(lo)))
    return out
