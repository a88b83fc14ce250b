"""Shared-prompt packing's layout by hand (parallel/prompt_tree.py); its logprobs and gradients
through forward_backward against HF on the full sequences are in test_grpo_invariance.py (TP=1,
TP=2, PP=2 and several micro-batch splits)."""

from __future__ import annotations

import pytest
import torch

from parallel.prompt_tree import shared_prompt_inputs, tree_tokens

# rows 0 and 2 share the prompt [10, 11, 12] (responses [20, 21] and [30]); row 1 has the prompt
# [40, 41] and the response [50, 51, 52]; 0 pads
IDS = torch.tensor([[10, 11, 12, 20, 21, 0], [40, 41, 50, 51, 52, 0], [10, 11, 12, 30, 0, 0]])
LENGTHS, PROMPTS = torch.tensor([5, 5, 4]), torch.tensor([3, 2, 3])
RESPONSE_MASK = torch.tensor([[0, 0, 1, 1, 0, 0], [0, 1, 1, 1, 0, 0], [0, 0, 1, 0, 0, 0]])


def test_trees_positions_masks_and_scoring_by_hand():
    x = shared_prompt_inputs(IDS, LENGTHS, PROMPTS, score_mask=RESPONSE_MASK)
    # one tree per prompt, in order of first appearance: [10 11 12 | 20 21 | 30], then [40 41 | 50 51 52]
    assert x.input_ids.tolist() == [[10, 11, 12, 20, 21, 30, 40, 41, 50, 51, 52]]
    assert x.position_ids.tolist() == [[0, 1, 2, 3, 4, 3, 0, 1, 2, 3, 4]]  # the second response restarts at 3
    p = x.packed_seq_params
    assert p.qkv_format == "thd" and p.cu_seqlens_q.tolist() == [0, 6, 11] and p.max_seqlen_q == 6
    first = torch.tensor([
        [1, 0, 0, 0, 0, 0],  # prompt: causal
        [1, 1, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0],
        [1, 1, 1, 1, 0, 0],  # 20: the prompt and itself
        [1, 1, 1, 1, 1, 0],  # 21: the prompt, 20 and itself
        [1, 1, 1, 0, 0, 1],  # 30: the prompt and itself, not the other response
    ], dtype=torch.bool)
    assert torch.equal(p.tree_masks[0], first)
    assert torch.equal(p.tree_masks[1], torch.ones(5, 5, dtype=torch.bool).tril())  # one response: causal
    # row 0 scores 20 at the prompt's last position (2), 21 at 20's (3); row 1 scores 50, 51, 52 at
    # tree positions 7, 8, 9; row 2 scores 30 at the shared prompt's last position (2) again
    assert x.score_index.tolist() == [2, 3, 7, 8, 9, 2]
    assert x.target_ids.tolist() == [[20, 21, 50, 51, 52, 30]]
    assert x.flat_index.tolist() == [2, 3, 7, 8, 9, 14]  # row * 6 + column
    assert x.seq_length == 11 == tree_tokens(IDS, LENGTHS, PROMPTS)  # 14 tokens, one copy of [10, 11, 12] less
    restored = x.restore(torch.tensor([[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]]))
    assert restored.tolist() == [[0, 0, 1, 2, 0, 0], [0, 3, 4, 5, 0, 0], [0, 0, 6, 0, 0, 0]]


def segment_mask(seg, total: int) -> torch.Tensor:
    """The ``[total, total]`` attention a :class:`TreeSegments` describes: query ``i`` of a segment
    of ``n`` queries and ``n_k`` keys sees its keys ``0 .. i + n_k - n`` (causal, bottom-right)."""
    mask = torch.zeros(total, total, dtype=torch.bool)
    cq, ck = seg.cu_seqlens_q.tolist(), seg.cu_seqlens_kv.tolist()
    for s in range(len(cq) - 1):
        n, nk = cq[s + 1] - cq[s], ck[s + 1] - ck[s]
        keys = seg.key_index[ck[s]:ck[s + 1]]
        for i in range(n):
            mask[cq[s] + i, keys[: i + nk - n + 1]] = True
    return mask


def test_tree_segments_by_hand_describe_the_tree_masks():
    """The varlen segments (GPU tree attention) by hand, and the same attention as the masks."""
    x = shared_prompt_inputs(IDS, LENGTHS, PROMPTS, score_mask=RESPONSE_MASK, pad_to=14)
    seg = x.packed_seq_params.tree_segments
    # [10 11 12 20 21] causal; [30] over the prompt + itself; [40 41 50 51 52] causal; padding [0 0 0]
    assert seg.cu_seqlens_q.tolist() == [0, 5, 6, 11, 14]
    assert seg.key_index.tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 5, 6, 7, 8, 9, 10, 11, 12, 13]
    assert seg.cu_seqlens_kv.tolist() == [0, 5, 9, 14, 17]
    assert (seg.max_seqlen_q, seg.max_seqlen_kv) == (5, 5)
    assert seg.cu_seqlens_q.dtype == seg.cu_seqlens_kv.dtype == torch.int32
    # random trees: 3 prompts, 1-4 responses each (some empty), several micro-batch orders
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        rows, prompts, lengths = [], [], []
        for _ in range(3):
            prompt = torch.randint(1, 100, (int(torch.randint(1, 6, (1,), generator=g)),), generator=g)
            for _ in range(int(torch.randint(1, 5, (1,), generator=g))):
                response = torch.randint(1, 100, (int(torch.randint(0, 5, (1,), generator=g)),), generator=g)
                rows.append(torch.cat([prompt, response]))
                prompts.append(len(prompt))
        order = torch.randperm(len(rows), generator=g).tolist()
        ids = torch.zeros(len(rows), max(len(r) for r in rows), dtype=torch.long)
        for i, j in enumerate(order):
            ids[i, : len(rows[j])] = rows[j]
            lengths.append(len(rows[j]))
        x = shared_prompt_inputs(ids, torch.tensor(lengths), torch.tensor([prompts[j] for j in order]))
        p = x.packed_seq_params
        full = torch.block_diag(*p.tree_masks)
        assert torch.equal(segment_mask(p.tree_segments, x.seq_length), full)


def test_every_real_column_without_a_mask_and_targets_past_the_end_are_padding():
    x = shared_prompt_inputs(IDS, LENGTHS, PROMPTS, pad_id=0)
    assert x.flat_index.numel() == 5 + 5 + 4
    # row 2 (flat 12..15): tokens 10 11 12 30 sit at tree positions 0 1 2 5 and predict 11 12 30 <pad>
    row2 = x.flat_index >= 12
    assert x.score_index[row2].tolist() == [0, 1, 2, 5]
    assert x.target_ids[0, row2].tolist() == [11, 12, 30, 0]


def test_padding_to_a_fixed_length_adds_one_causal_sequence():
    x = shared_prompt_inputs(IDS, LENGTHS, PROMPTS, score_mask=RESPONSE_MASK, pad_id=0, pad_to=14)
    assert x.seq_length == 14 and x.input_ids[0, 11:].tolist() == [0, 0, 0]
    assert x.packed_seq_params.cu_seqlens_q.tolist() == [0, 6, 11, 14]
    assert torch.equal(x.packed_seq_params.tree_masks[2], torch.ones(3, 3, dtype=torch.bool).tril())
    assert x.score_index.tolist() == [2, 3, 7, 8, 9, 2]  # scoring unchanged


def test_nothing_to_score_keeps_one_placeholder_that_restores_to_zeros():
    x = shared_prompt_inputs(IDS, LENGTHS, PROMPTS, score_mask=torch.zeros_like(IDS))
    assert x.score_index.tolist() == [0] and x.flat_index.tolist() == [18]
    assert x.restore(torch.tensor([[7.0]])).abs().sum() == 0


def test_bad_lengths_and_padding_are_refused():
    with pytest.raises(ValueError, match="prompt_lengths"):
        shared_prompt_inputs(IDS, LENGTHS, torch.tensor([3, 6, 3]))  # prompt longer than the row
    with pytest.raises(ValueError, match="prompt_lengths"):
        shared_prompt_inputs(IDS, torch.tensor([5, 7, 4]), PROMPTS)  # row longer than seq
    with pytest.raises(ValueError, match="pad_to=10"):
        shared_prompt_inputs(IDS, LENGTHS, PROMPTS, pad_to=10)
