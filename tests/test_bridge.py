"""The Llama family's table (through :class:`alignment.models.bridge.Bridge`) against layouts
written out by hand (Megatron-LM's checkpoint conventions), each direction on its own, so that a
bug mirrored in import and export cannot hide behind a round trip; and the family registry."""

from __future__ import annotations

import pytest
import torch

from alignment.models import llama
from alignment.models.bridge import Bridge
from alignment.models.dims import ModelDims
from alignment.models.families import get_bridge, model_dims


def LlamaBridge(dims, head="lm"):
    return Bridge(llama.FAMILY, dims, head=head)


# 4 query heads, 2 KV heads (2 query heads per group), head_dim 1, hidden 1, ffn 2, vocab 3
DIMS = ModelDims(num_layers=1, hidden_size=1, num_attention_heads=4, num_query_groups=2, head_dim=1,
                 ffn_hidden_size=2, vocab_size=3, tie_word_embeddings=False, make_vocab_size_divisible_by=2)
B = LlamaBridge(DIMS)
QKV = "decoder.layers.0.self_attention.linear_qkv.weight"
HF = {  # values name themselves: q heads 10-13, k heads 20-21, v heads 30-31, gate 40-41, up 50-51
    "model.layers.0.self_attn.q_proj.weight": torch.tensor([[10.], [11.], [12.], [13.]]),
    "model.layers.0.self_attn.k_proj.weight": torch.tensor([[20.], [21.]]),
    "model.layers.0.self_attn.v_proj.weight": torch.tensor([[30.], [31.]]),
    "model.layers.0.mlp.gate_proj.weight": torch.tensor([[40.], [41.]]),
    "model.layers.0.mlp.up_proj.weight": torch.tensor([[50.], [51.]]),
    "model.layers.0.mlp.down_proj.weight": torch.tensor([[60., 61.]]),
    "model.embed_tokens.weight": torch.tensor([[70.], [71.], [72.]]),
}


def col(*v):
    return torch.tensor([[float(x)] for x in v])


def test_import_qkv_is_interleaved_per_query_group():
    # Megatron: for each KV group [q_a, q_b, k, v]; TP=2 gives each rank one whole group.
    assert torch.equal(B.to_megatron_shard(QKV, HF, 0, 1), col(10, 11, 20, 30, 12, 13, 21, 31))
    assert torch.equal(B.to_megatron_shard(QKV, HF, 0, 2), col(10, 11, 20, 30))
    assert torch.equal(B.to_megatron_shard(QKV, HF, 1, 2), col(12, 13, 21, 31))


def test_import_gate_up_and_vocab_padding_and_row_split():
    fc1 = "decoder.layers.0.mlp.linear_fc1.weight"
    assert torch.equal(B.to_megatron_shard(fc1, HF, 0, 1), col(40, 41, 50, 51))
    assert torch.equal(B.to_megatron_shard(fc1, HF, 0, 2), col(40, 50))  # [gate_r; up_r]
    assert torch.equal(B.to_megatron_shard(fc1, HF, 1, 2), col(41, 51))
    emb = "embedding.word_embeddings.weight"  # vocab 3 -> padded to 4 (multiple of 2 x TP 2)
    assert torch.equal(B.to_megatron_shard(emb, HF, 0, 2), col(70, 71))
    assert torch.equal(B.to_megatron_shard(emb, HF, 1, 2), col(72, 0))
    fc2 = "decoder.layers.0.mlp.linear_fc2.weight"
    assert torch.equal(B.to_megatron_shard(fc2, HF, 1, 2), torch.tensor([[61.]]))


def test_export_from_hand_written_megatron_shards():
    out = B.to_hf(QKV, [col(10, 11, 20, 30), col(12, 13, 21, 31)])
    assert torch.equal(out["model.layers.0.self_attn.q_proj.weight"], col(10, 11, 12, 13))
    assert torch.equal(out["model.layers.0.self_attn.k_proj.weight"], col(20, 21))
    assert torch.equal(out["model.layers.0.self_attn.v_proj.weight"], col(30, 31))
    out = B.to_hf("decoder.layers.0.mlp.linear_fc1.weight", [col(40, 50), col(41, 51)])
    assert torch.equal(out["model.layers.0.mlp.gate_proj.weight"], col(40, 41))
    assert torch.equal(out["model.layers.0.mlp.up_proj.weight"], col(50, 51))
    out = B.to_hf("embedding.word_embeddings.weight", [col(70, 71), col(72, 0)])
    assert torch.equal(out["model.embed_tokens.weight"], col(70, 71, 72))  # padding dropped
    out = B.to_hf("decoder.layers.0.mlp.linear_fc2.weight", [torch.tensor([[60.]]), torch.tensor([[61.]])])
    assert torch.equal(out["model.layers.0.mlp.down_proj.weight"], torch.tensor([[60., 61.]]))
    out = B.to_hf("decoder.layers.0.pre_mlp_layernorm.weight", [torch.tensor([5.])])
    assert list(out) == ["model.layers.0.post_attention_layernorm.weight"]


def test_names_shapes_and_errors():
    assert B.hf_names("output_layer.weight") == ["lm_head.weight"]
    assert B.hf_names("decoder.layers.0.self_attention.linear_qkv.layer_norm_weight") == [
        "model.layers.0.input_layernorm.weight"]  # transformer-engine fused-norm name
    assert DIMS.padded_vocab_size(2) == 4 and DIMS.padded_vocab_size(1) == 4
    tied = LlamaBridge(ModelDims(**{**DIMS.__dict__, "tie_word_embeddings": True}))
    assert "output_layer.weight" not in tied.megatron_names()
    assert tied.to_hf("output_layer.weight", [col(1, 2)]) == {}
    with pytest.raises(KeyError, match="no HF mapping"):
        B.hf_names("decoder.layers.0.mlp.router.weight")  # a dense Llama has no router


def test_score_head_maps_to_hf_sequence_classifier():
    tied = ModelDims(**{**DIMS.__dict__, "tie_word_embeddings": True})
    lm, rm = LlamaBridge(tied), LlamaBridge(tied, head="score")
    # tied LM: no output layer of its own; reward model: the head is score.weight [1, hidden]
    assert "output_layer.weight" not in lm.megatron_names() and lm.output_layer_tied
    assert rm.megatron_names()[-1] == "output_layer.weight" and not rm.output_layer_tied
    assert rm.hf_names("output_layer.weight") == ["score.weight"]
    score = {"score.weight": torch.tensor([[7.0]])}
    for tp_rank in (0, 1):  # replicated on every TP rank, not vocabulary-split
        assert torch.equal(rm.to_megatron_shard("output_layer.weight", score, tp_rank, 2), score["score.weight"])
    assert torch.equal(rm.to_hf("output_layer.weight", [torch.tensor([[7.0]])])["score.weight"], torch.tensor([[7.0]]))
    with pytest.raises(ValueError, match="head="):
        LlamaBridge(DIMS, head="value")


def test_qwen2_qkv_bias_is_interleaved_like_the_weight():
    from transformers import Qwen2Config

    cfg = Qwen2Config(vocab_size=64, hidden_size=8, intermediate_size=8, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, architectures=["Qwen2ForCausalLM"])
    d = model_dims(cfg)  # head_dim 2, groups of 2 query heads
    assert d.qkv_bias
    b = LlamaBridge(d)
    assert "decoder.layers.0.self_attention.linear_qkv.bias" in b.megatron_names()
    p = "model.layers.0.self_attn."
    hf = {p + "q_proj.bias": torch.arange(8.0), p + "k_proj.bias": 100 + torch.arange(4.0),
          p + "v_proj.bias": 200 + torch.arange(4.0)}
    name = "decoder.layers.0.self_attention.linear_qkv.bias"
    # TP rank 0 holds query group 0: q heads 0,1 (elements 0..3), k head 0, v head 0
    assert b.to_megatron_shard(name, hf, 0, 2).tolist() == [0, 1, 2, 3, 100, 101, 200, 201]
    assert b.to_megatron_shard(name, hf, 1, 2).tolist() == [4, 5, 6, 7, 102, 103, 202, 203]
    back = b.to_hf(name, [b.to_megatron_shard(name, hf, j, 2) for j in range(2)])
    assert all(torch.equal(back[k], hf[k]) for k in hf)


def test_family_registry_and_export_architecture():
    from transformers import GPT2Config, LlamaConfig, Qwen2Config

    small = dict(vocab_size=64, hidden_size=8, intermediate_size=8, num_hidden_layers=1, num_attention_heads=2)
    assert get_bridge(Qwen2Config(**small, architectures=["Qwen2ForCausalLM"]), head="score").hf_architecture \
        == "Qwen2ForSequenceClassification"
    rm = LlamaConfig(**small, architectures=["LlamaForSequenceClassification"])
    assert get_bridge(rm).hf_architecture == "LlamaForCausalLM"  # a reward model exported as an LM
    assert get_bridge(rm, head="score").hf_architecture == "LlamaForSequenceClassification"
    with pytest.raises(ValueError, match="'GPT2LMHeadModel' is not supported; supported: LlamaForCausalLM, "):
        get_bridge(GPT2Config(architectures=["GPT2LMHeadModel"]))
    with pytest.raises(ValueError, match="use_sliding_window=true"):
        model_dims(Qwen2Config(**small, architectures=["Qwen2ForCausalLM"], use_sliding_window=True))
