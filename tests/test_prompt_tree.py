"""Shared-prompt packing's layout by hand (parallel/prompt_tree.py); its logprobs and gradients
against HF on the full sequences are in test_grpo_invariance.py (TP=1 and TP=2)."""

from __future__ import annotations

import pytest
import torch

from parallel.prompt_tree import prompt_tree


def test_layout_positions_mask_and_scoring_positions_by_hand():
    # prompt [10, 11, 12], responses [20, 21] and [30]
    tree = prompt_tree(torch.tensor([10, 11, 12]), [torch.tensor([20, 21]), torch.tensor([30])])
    assert tree.input_ids.tolist() == [[10, 11, 12, 20, 21, 30]]
    assert tree.position_ids.tolist() == [[0, 1, 2, 3, 4, 3]]  # the second response restarts at 3
    expected = torch.tensor([
        [1, 0, 0, 0, 0, 0],  # prompt: causal
        [1, 1, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0],
        [1, 1, 1, 1, 0, 0],  # 20: the prompt and itself
        [1, 1, 1, 1, 1, 0],  # 21: the prompt, 20 and itself
        [1, 1, 1, 0, 0, 1],  # 30: the prompt and itself, not the other response
    ], dtype=torch.bool)
    assert torch.equal(tree.packed_seq_params.tree_mask, expected)
    # 20 and 30 are both scored at the prompt's last position (2); 21 at 20's position (3)
    assert tree.score_index.tolist() == [2, 3, 2]
    assert tree.target_ids.tolist() == [20, 21, 30]
    p = tree.packed_seq_params
    assert p.qkv_format == "thd" and p.cu_seqlens_q.tolist() == [0, 6] and p.max_seqlen_q == 6


def test_empty_parts_are_refused():
    with pytest.raises(ValueError, match="non-empty prompt"):
        prompt_tree(torch.tensor([], dtype=torch.long), [torch.tensor([1])])
    with pytest.raises(ValueError, match=r"response lengths \[1, 0\]"):
        prompt_tree(torch.tensor([1]), [torch.tensor([1]), torch.tensor([], dtype=torch.long)])
    with pytest.raises(ValueError):
        prompt_tree(torch.tensor([1]), [])
