"""Sequence packing, the zig-zag context-parallel split, Karmarkar-Karp balancing and
token-budget micro-batches, against hand-computed values; and the layout checks for
context parallelism and Ulysses."""

from __future__ import annotations

import pytest
import torch

from parallel.balance import karmarkar_karp, token_budget_partition
from parallel.context_parallel import zigzag_index
from parallel.layout import LayoutError, ParallelLayout, validate_layout
from parallel.packing import alignment, model_inputs
from parallel.ulysses import check_ulysses_heads


def test_zigzag_index_hand_computed():
    # one sequence of 8 over 2 ranks: chunks of 2; rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2
    assert zigzag_index([8], 2).tolist() == [[0, 1, 6, 7], [2, 3, 4, 5]]
    # packed: a sequence of 4 (chunks of 1) then one of 8 starting at 4 (chunks of 2)
    assert zigzag_index([4, 8], 2).tolist() == [[0, 3, 4, 5, 10, 11], [1, 2, 6, 7, 8, 9]]
    four = zigzag_index([8], 4).tolist()
    assert four == [[0, 7], [1, 6], [2, 5], [3, 4]]  # every rank: one early and one late chunk
    with pytest.raises(ValueError, match="multiple of 2 x context_parallel_size = 4"):
        zigzag_index([6], 2)


def test_alignment():
    assert alignment(1, 4, False) == 1 and alignment(1, 4, True) == 4
    assert alignment(2, 1, False) == 4 and alignment(2, 2, True) == 8


def _batch():
    ids = torch.tensor([[11, 12, 13, 0, 0, 0], [21, 22, 23, 24, 25, 0]])
    return ids, torch.tensor([3, 5])


def test_packed_inputs_without_context_parallelism():
    ids, lengths = _batch()
    inp = model_inputs(ids, lengths, packed=True, pad_id=0)
    assert inp.input_ids.tolist() == [[11, 12, 13, 21, 22, 23, 24, 25]]
    assert inp.position_ids.tolist() == [[0, 1, 2, 0, 1, 2, 3, 4]]  # restart per sequence
    # each token's target is the next token of ITS sequence (pad after the last), never the next sequence's
    assert inp.target_ids.tolist() == [[12, 13, 0, 22, 23, 24, 25, 0]]
    p = inp.packed_seq_params
    assert p.qkv_format == "thd" and p.cu_seqlens_q.tolist() == [0, 3, 8] and p.max_seqlen_q == 5
    restored = inp.restore(inp.input_ids.float())
    assert restored.tolist() == (ids * (torch.arange(6) < lengths.unsqueeze(1))).float().tolist()
    assert inp.stream_index().tolist() == [[0, 1, 2, 6, 7, 8, 9, 10]]
    with pytest.raises(ValueError, match="not packed"):
        model_inputs(ids, lengths, packed=False, pad_id=0).stream_index()


def test_packed_inputs_padded_for_context_parallelism_and_pipeline():
    ids, lengths = _batch()
    ranks = [model_inputs(ids, lengths, packed=True, pad_id=0, cp_size=2, cp_rank=r, align=4, pad_to=16)
             for r in range(2)]
    p = ranks[0].packed_seq_params
    # lengths 3 and 5 padded to 4 and 8; pad_to=16 adds a 4-token padding sequence
    assert p.cu_seqlens_q_padded.tolist() == [0, 4, 12, 16] and p.cu_seqlens_q.tolist() == [0, 3, 8, 12]
    assert ranks[0].seq_length == 16 and ranks[0].input_ids.shape == (1, 8)
    # rank 0 holds chunk 0 and 3 of each sequence: [11 | pad] [21 22 | 25 pad] [pad | pad]
    assert ranks[0].input_ids.tolist() == [[11, 0, 21, 22, 0, 0, 0, 0]]
    assert ranks[1].input_ids.tolist() == [[12, 13, 23, 24, 25, 0, 0, 0]]
    assert ranks[0].position_ids.tolist() == [[0, 3, 0, 1, 6, 7, 0, 3]]
    # together the ranks cover every real token exactly once
    seen = torch.cat([r.index[k].flatten() for k, r in enumerate(ranks)])
    real = seen[seen >= 0].sort().values.tolist()
    assert real == [0, 1, 2, 6, 7, 8, 9, 10]
    # the whole stream in its own order, the same on every rank (what a per-token thd rotary table is indexed by)
    for r in ranks:
        assert r.stream_index().tolist() == [[0, 1, 2, -1, 6, 7, 8, 9, 10, -1, -1, -1, -1, -1, -1, -1]]


def test_unpacked_inputs_trim_to_the_longest_row_and_split():
    ids, lengths = _batch()
    inp = model_inputs(ids, lengths, packed=False, pad_id=0)
    assert inp.input_ids.shape == (2, 5) and inp.packed_seq_params is None  # trimmed from 6 to 5 columns
    two = model_inputs(ids, lengths, packed=False, pad_id=0, cp_size=2, cp_rank=1, align=4)
    # width 8 (6 columns + 2 alignment columns); rank 1 holds columns 2..5
    assert two.input_ids.tolist() == [[13, 0, 0, 0], [23, 24, 25, 0]]
    assert two.index[1].tolist() == [[2, 3, 4, 5], [8, 9, 10, 11]]
    assert two.index[0].tolist() == [[0, 1, -1, -1], [6, 7, -1, -1]]  # columns 6, 7: alignment padding
    with pytest.raises(ValueError, match="seq_lengths"):
        model_inputs(ids, torch.tensor([3, 7]), packed=True, pad_id=0)
    with pytest.raises(ValueError, match="multiple of 2 x context_parallel_size"):
        model_inputs(ids, lengths, packed=True, pad_id=0, cp_size=2, align=2)


def test_restore_is_differentiable():
    ids, lengths = _batch()
    inp = model_inputs(ids, lengths, packed=True, pad_id=0)
    x = torch.arange(8.0, requires_grad=True)
    (inp.restore(x.view(1, 8)) * torch.arange(12.0).view(2, 6)).sum().backward()
    # packed token k came from row/col: 0,1,2 -> (0,0..2); 3..7 -> (1,0..4): flat positions 0,1,2,6..10
    assert x.grad.tolist() == [0, 1, 2, 6, 7, 8, 9, 10]


def test_karmarkar_karp_balances():
    parts = karmarkar_karp([5, 4, 3, 3, 3, 2], 2, equal_size=True)
    assert sorted(len(p) for p in parts) == [3, 3]
    assert sorted(sum([5, 4, 3, 3, 3, 2][i] for i in p) for p in parts) == [10, 10]
    assert sorted(i for p in parts for i in p) == list(range(6))
    # differencing 8-7 -> 1, 6-5 -> 1, 4-1 -> 3, 3-1 -> 2 ends at 16 vs 14, where greedy (largest
    # first into the lighter part) ends at 17 vs 13
    w = [8, 7, 6, 5, 4]
    assert sorted(sum(w[i] for i in p) for p in karmarkar_karp(w, 2)) == [14, 16]
    assert karmarkar_karp([3], 3) == [[0], [], []]
    with pytest.raises(ValueError, match="equal size"):
        karmarkar_karp([1, 2, 3], 2, equal_size=True)


def test_token_budget_partition_fewest_parts_within_budget():
    w = [10, 9, 8, 7, 6]  # 40 tokens, budget 20: no subset sums to 20, so 3 parts are needed
    parts = token_budget_partition(w, 20)
    assert len(parts) == 3 and all(sum(w[i] for i in p) <= 20 for p in parts)
    assert sorted(i for p in parts for i in p) == list(range(5))
    assert len(token_budget_partition([5, 5, 5, 5], 10)) == 2
    with pytest.raises(ValueError, match="trainer.max_tokens_per_microbatch=8 is smaller than a sequence of 10"):
        token_budget_partition([10, 2], 8)


def test_split_by_token_budget_keeps_pairs_and_restores_order():
    from alignment.training.batching import cat_rows, split_microbatches

    batch = {"input_ids": torch.arange(6).unsqueeze(1), "seq_lengths": torch.tensor([9, 8, 2, 2, 5, 4])}
    mbs = split_microbatches(batch, 1, max_tokens=17, rows_per_unit=2)  # pairs of 17, 4, 9 tokens
    for mb in mbs:  # every pair stays together, chosen first
        assert mb["row_index"].view(-1, 2)[:, 0].remainder(2).eq(0).all()
        assert mb["seq_lengths"].sum() <= 17
    assert len(mbs) == 2
    out = [{"x": mb["input_ids"][:, 0] * 10} for mb in mbs]
    assert cat_rows(out, "x", mbs).tolist() == [0, 10, 20, 30, 40, 50]


def test_layout_checks_for_context_parallel_and_ulysses():
    kw = dict(num_layers=30, num_attention_heads=9, num_query_groups=3)
    validate_layout(ParallelLayout(world_size=4, context_parallel_size=2), **kw)
    validate_layout(ParallelLayout(world_size=6, context_parallel_size=3, cp_comm_type="a2a"), **kw)
    with pytest.raises(LayoutError, match=r"context_parallel_size=2 with parallel.cp_comm_type=a2a .*9 query heads"
                                          r".*valid Ulysses sizes here: \[3\]"):
        validate_layout(ParallelLayout(world_size=6, context_parallel_size=2, cp_comm_type="a2a"), **kw)
    with pytest.raises(LayoutError, match="context_parallel_size to one of"):
        validate_layout(ParallelLayout(world_size=6, context_parallel_size=4), **kw)
    with pytest.raises(LayoutError, match="cp_comm_type='ring'"):
        validate_layout(ParallelLayout(world_size=2, context_parallel_size=2, cp_comm_type="ring"), **kw)
    assert ParallelLayout(world_size=8, tensor_model_parallel_size=2, context_parallel_size=2).data_parallel_size == 2
    assert check_ulysses_heads(4, 2, 4) is None  # KV heads replicated 2x
    assert "KV heads" in check_ulysses_heads(6, 3, 2)


def test_global_batch_share_contiguous_or_balanced_by_hand():
    from alignment.training.dp_balance import global_batch_share

    lengths = [8, 7, 6, 5, 4, 3, 2, 1]  # 36 tokens
    assert global_batch_share(lengths, 2, 0, False) == ([0, 1, 2, 3], 26 * 2 / 36)  # 26 vs 10 tokens
    assert global_batch_share(lengths, 2, 1, False)[0] == [4, 5, 6, 7]
    a, imbalance = global_batch_share(lengths, 2, 0, True)
    b, _ = global_batch_share(lengths, 2, 1, True)
    assert sorted(a + b) == list(range(8)) and len(a) == len(b) == 4
    assert sum(lengths[i] for i in a) == sum(lengths[i] for i in b) == 18 and imbalance == 1.0
    with pytest.raises(ValueError, match="7 examples cannot be split over 2 data-parallel ranks"):
        global_batch_share(lengths[:7], 2, 0, True)
