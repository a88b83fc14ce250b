"""Megatron shards -> vLLM tensor-parallel layout (parallel/vllm_layout.py), checked against
vLLM's OWN sharding code: every destination tensor must equal what vLLM's weight loaders
(``QKVParallelLinear``, ``MergedColumnParallelLinear``, ``RowParallelLinear``,
``VocabParallelEmbedding``, called by ``weight_check.vllm_reference_shard`` with the layer's TP
attributes) put into that vLLM TP rank's parameter from the full HF tensors.

Matrix: MHA, GQA, MQA, KV heads < vLLM TP, Qwen2-style QKV bias, tied and untied heads,
non-square attention (heads x head_dim != hidden), vocabularies that are multiples of
neither 64 nor 128; Megatron TP 1/2/4 x vLLM TP 1/2/4 wherever both can split the model.
"""

from __future__ import annotations


import pytest
import torch

from alignment.models.bridges.llama import LlamaBridge, LlamaDims
from alignment.rollout.weight_check import vllm_reference_shard
from parallel.vllm_layout import ANY_TP_RANK, Piece, assemble, check_tp_sizes, vllm_tensors

pytest.importorskip("vllm")

MODELS = {  # name: (heads, kv heads, head_dim, hidden, ffn, vocab, tied, qkv bias)
    "mha": (4, 4, 16, 48, 96, 250, False, False),
    "gqa": (8, 2, 8, 40, 48, 300, True, False),
    "mqa": (4, 1, 16, 32, 64, 250, False, False),
    "qwen2_bias": (8, 4, 8, 48, 64, 333, False, True),
}


def dims_of(name: str) -> LlamaDims:
    nq, nkv, hd, h, f, v, tied, bias = MODELS[name]
    return LlamaDims(num_layers=2, hidden_size=h, num_attention_heads=nq, num_query_groups=nkv, head_dim=hd,
                     ffn_hidden_size=f, vocab_size=v, tie_word_embeddings=tied, qkv_bias=bias)


def hf_state(d: LlamaDims) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    bridge = LlamaBridge(d)
    names = {n for mg in bridge.megatron_names() for n in bridge.hf_names(mg)}
    return {n: torch.randn(bridge.hf_shape(n), generator=g) for n in sorted(names)}


def layouts():
    for model in MODELS:
        d = dims_of(model)
        for s in (1, 2, 4):
            for t in (1, 2, 4):
                try:
                    check_tp_sizes(d, s, t)
                except ValueError:
                    continue
                yield pytest.param(model, s, t, id=f"{model}-megatron_tp{s}-vllm_tp{t}")


@pytest.mark.parametrize("model,s,t", list(layouts()))
def test_every_vllm_tensor_equals_vllms_own_sharding(model, s, t):
    d = dims_of(model)
    hf = hf_state(d)
    bridge = LlamaBridge(d)
    shards = {(mg, j): bridge.to_megatron_shard(mg, hf, j, s) for mg in bridge.megatron_names() for j in range(s)}

    def shard(name, j):
        return shards[(name, 0 if j == ANY_TP_RANK else j)]

    n_expected = 2 + 2 * (6 + d.qkv_bias) + (not d.tie_word_embeddings)
    for r in range(t):
        tensors = vllm_tensors(d, s, t, r, qkv_bias=d.qkv_bias)
        assert len(tensors) == n_expected
        for tensor in tensors:
            got = assemble(tensor, shard)
            want = vllm_reference_shard(d, hf, tensor.name, t, r)
            assert got.shape == want.shape == tensor.shape, tensor.name
            assert torch.equal(got, want), (tensor.name, r)


def test_the_matrix_covers_the_hard_cases():
    ids = {p.id for p in layouts()}
    assert "gqa-megatron_tp2-vllm_tp4" in ids  # KV heads (2) < vLLM TP (4): replicated KV heads
    assert "mqa-megatron_tp1-vllm_tp4" in ids  # one KV head on every vLLM rank
    assert "mha-megatron_tp4-vllm_tp1" in ids and "mha-megatron_tp1-vllm_tp4" in ids
    assert "qwen2_bias-megatron_tp4-vllm_tp2" in ids
    assert len(ids) >= 24


def test_equal_tp_is_a_local_rewrite_with_few_pieces():
    d = dims_of("gqa")
    for r in range(2):
        for tensor in vllm_tensors(d, 2, 2, r):
            # every piece comes from the destination's own TP rank (or a replicated parameter) ...
            local = all(p.source_tp_rank in (r, ANY_TP_RANK) for p in tensor.pieces)
            # ... except vocabulary rows: Megatron pads 300 to 512 (256 rows per rank), vLLM to 320 (160
            # per rank), so vLLM rank 1's rows 160..299 start on Megatron rank 0
            assert local or (tensor.name == "model.embed_tokens.weight" and r == 1), tensor.name
    # a vocabulary that both pad alike (SmolLM2's 49,152 = 192 x 256) is local too
    smol = LlamaDims(num_layers=1, hidden_size=40, num_attention_heads=8, num_query_groups=2, head_dim=8,
                     ffn_hidden_size=48, vocab_size=49152, tie_word_embeddings=True)
    for r in range(2):
        assert all(p.source_tp_rank in (r, ANY_TP_RANK) for t in vllm_tensors(smol, 2, 2, r) for p in t.pieces)
    # one KV group per rank: Megatron's [q_0..q_3, k, v] of that group IS vLLM's [q; k; v]: one piece,
    # the whole shard
    qkv = next(t for t in vllm_tensors(d, 2, 2, 0) if t.name.endswith("qkv_proj.weight"))
    assert qkv.pieces == (Piece("decoder.layers.0.self_attention.linear_qkv.weight", 0, 0, 0, 0, 48),)
    # two KV groups per rank (TP 1): q heads of both groups first, then both k, then both v
    qkv = next(t for t in vllm_tensors(d, 1, 1, 0) if t.name.endswith("qkv_proj.weight"))
    assert [(p.source_start, p.dest_start, p.length) for p in qkv.pieces] == [
        (0, 0, 32), (48, 32, 32), (32, 64, 8), (80, 72, 8), (40, 80, 8), (88, 88, 8)]


def test_sizes_that_cannot_split_are_refused():
    d = dims_of("gqa")  # 8 heads, 2 KV heads, ffn 48
    with pytest.raises(ValueError, match="parallel.tensor_model_parallel_size=4 must divide"):
        check_tp_sizes(d, 4, 1)  # Megatron needs whole KV groups per rank
    with pytest.raises(ValueError, match="rollout.tensor_parallel_size=3"):
        check_tp_sizes(d, 1, 3)
