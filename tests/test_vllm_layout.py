"""Megatron shards -> vLLM tensor-parallel layout (the family tables' vLLM rows,
``Bridge.vllm_tensors``), checked against vLLM's OWN sharding code: every destination tensor
must equal what vLLM's weight loaders (``QKVParallelLinear``, ``MergedColumnParallelLinear``,
``RowParallelLinear``, ``VocabParallelEmbedding``, fused MoE ``RoutedExperts``; called by
``weight_check.vllm_reference_shard`` with the layer's TP attributes) put into that vLLM TP
rank's parameter from the full HF checkpoint tensors.

Matrix: MHA, GQA, MQA, KV heads < vLLM TP, Qwen2-style QKV bias, Qwen3 QK-norm, Qwen3-MoE
(router, experts stacked into fused ``w13`` / ``w2``, a dense layer, expert TP 1 or = TP), Qwen2.5-VL
and Qwen3-VL (the language model under vLLM's ``language_model.``, the vision tower replicated in
Megatron and split by vLLM: checkpoint-fused QKV, merged gate / up, column / row pairs), tied
and untied heads, non-square attention (heads x head_dim != hidden), vocabularies that are
multiples of neither 64 nor 128; Megatron TP 1/2/4 x vLLM TP 1/2/4 wherever both can split the
model. HF tensors come from real transformers models of each family (checkpoint form).
"""

from __future__ import annotations


import pytest
import torch

from alignment.models import llama
from alignment.models.bridge import Bridge
from alignment.models.dims import ModelDims
from alignment.models.families import get_bridge, model_dims
from alignment.rollout.engines.weight_check import vllm_reference_shard
from parallel.pieces import ANY_TP_RANK, Piece, assemble

pytest.importorskip("vllm")

def _llama(nq, nkv, hd, h, f, v, tied):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=v, hidden_size=h, intermediate_size=f, num_hidden_layers=2, num_attention_heads=nq,
                       num_key_value_heads=nkv, head_dim=hd, tie_word_embeddings=tied,
                       architectures=["LlamaForCausalLM"])


def _qwen2():
    from transformers import Qwen2Config

    return Qwen2Config(vocab_size=333, hidden_size=48, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=8, num_key_value_heads=4, tie_word_embeddings=False,
                       architectures=["Qwen2ForCausalLM"])


def _qwen3():
    from transformers import Qwen3Config

    return Qwen3Config(vocab_size=300, hidden_size=48, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=8, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True,
                       architectures=["Qwen3ForCausalLM"])


def _qwen3_moe():
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(vocab_size=250, hidden_size=40, intermediate_size=48, moe_intermediate_size=32,
                          num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4, head_dim=8,
                          num_experts=4, num_experts_per_tok=2, mlp_only_layers=[1], tie_word_embeddings=False,
                          architectures=["Qwen3MoeForCausalLM"])


def _qwen2_5_vl():
    from tests.dist.tiny_models import tiny_qwen2_5_vl_config

    return tiny_qwen2_5_vl_config()


def _qwen3_vl():
    from tests.dist.tiny_models import tiny_qwen3_vl_config

    return tiny_qwen3_vl_config(tie_word_embeddings=True)


def _qwen3_vl_moe():
    from tests.dist.tiny_models import tiny_qwen3_vl_moe_config

    return tiny_qwen3_vl_moe_config(tie_word_embeddings=True)


MODELS = {  # name: (HF config, vLLM tensors per rank: embed + final norm (+ lm_head) + per layer)
    "mha": (lambda: _llama(4, 4, 16, 48, 96, 250, False), 3 + 2 * 6),
    "gqa": (lambda: _llama(8, 2, 8, 40, 48, 300, True), 2 + 2 * 6),
    "mqa": (lambda: _llama(4, 1, 16, 32, 64, 250, False), 3 + 2 * 6),
    "qwen2_bias": (_qwen2, 3 + 2 * 7),  # + qkv bias
    "qwen3_tied": (_qwen3, 2 + 2 * 8),  # + q_norm, k_norm
    "qwen3_moe": (_qwen3_moe, 3 + 9 + 8),  # MoE layer: attention 6 + router + w13 + w2; dense layer 8
    # + the vision tower: patch embedding, per block 2 norms + qkv, proj, gate_up, down (weight and bias
    # each: 8), the merger's norm + 2 linears (5); Qwen3-VL: patch bias, position table, LayerNorm
    # biases (12 per block), the merger and 2 DeepStack mergers (6 each)
    "qwen2_5_vl": (_qwen2_5_vl, 3 + 4 * 7 + 1 + 2 * 10 + 5),
    "qwen3_vl": (_qwen3_vl, 2 + 4 * 8 + 3 + 3 * 12 + 3 * 6),
    # Qwen3-VL's tower over Qwen3-MoE's layers (3 MoE, 1 dense), the experts fused in the checkpoint
    "qwen3_vl_moe": (_qwen3_vl_moe, 2 + 3 * 9 + 8 + 3 + 3 * 12 + 3 * 6),
}
VISION = ("qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe")
CACHE: dict = {}


def model(name: str):
    """``(bridge, HF checkpoint state)`` of a random HF model of that config (cached)."""
    if name not in CACHE:
        from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

        from tests.dist.tiny_models import checkpoint_state, randomize

        cfg = MODELS[name][0]()
        auto = AutoModelForImageTextToText if name in VISION else AutoModelForCausalLM
        hf = randomize(lambda: auto.from_config(cfg), seed=0)
        CACHE[name] = (get_bridge(cfg), checkpoint_state(hf))
    return CACHE[name]


def dims_of(name: str) -> ModelDims:
    return model_dims(MODELS[name][0]())


def check_tp_sizes(d: ModelDims, s: int, t: int, etp: int | None = None) -> None:
    Bridge(llama.FAMILY, d).check_tp_sizes(s, t, etp)


def vllm_tensors(d: ModelDims, s: int, t: int, r: int):
    return Bridge(llama.FAMILY, d).vllm_tensors(s, t, r)


def layouts():
    for name in MODELS:
        bridge = get_bridge(MODELS[name][0]())
        for s in (1, 2, 4):
            for t in (1, 2, 4):
                for etp in sorted({s, 1}) if bridge.dims.num_experts else [None]:
                    try:
                        bridge.check_tp_sizes(s, t, etp)
                    except ValueError:
                        continue
                    suffix = f"-expert_tp{etp}" if etp else ""
                    yield pytest.param(name, s, t, etp, id=f"{name}-megatron_tp{s}-vllm_tp{t}{suffix}")


@pytest.mark.parametrize("name,s,t,etp", list(layouts()))
def test_every_vllm_tensor_equals_vllms_own_sharding(name, s, t, etp):
    bridge, hf = model(name)
    shards, per_expert = {}, bridge.checkpoint_view(hf)  # Qwen3-VL-MoE's fused experts read per expert

    def shard(mg, j):
        size = (etp or s) if bridge.is_expert(mg) else s
        j = 0 if j == ANY_TP_RANK else j
        if (mg, j) not in shards:
            shards[(mg, j)] = bridge.to_megatron_shard(mg, per_expert, j, size)
        return shards[(mg, j)]

    for r in range(t):
        tensors = bridge.vllm_tensors(s, t, r, etp)
        assert len(tensors) == MODELS[name][1]
        for tensor in tensors:
            got = assemble(tensor, shard)
            want = vllm_reference_shard(bridge, hf, tensor.name, t, r)
            assert got.shape == want.shape == tensor.shape, tensor.name
            assert torch.equal(got, want), (tensor.name, r)


def test_the_matrix_covers_the_hard_cases():
    ids = {p.id for p in layouts()}
    assert "gqa-megatron_tp2-vllm_tp4" in ids  # KV heads (2) < vLLM TP (4): replicated KV heads
    assert "mqa-megatron_tp1-vllm_tp4" in ids  # one KV head on every vLLM rank
    assert "mha-megatron_tp4-vllm_tp1" in ids and "mha-megatron_tp1-vllm_tp4" in ids
    assert "qwen2_bias-megatron_tp4-vllm_tp2" in ids
    assert "qwen3_tied-megatron_tp2-vllm_tp4" in ids  # QK-norm, 2 KV heads replicated on 4 vLLM ranks
    # experts: width 32 split 4 ways by vLLM and 2 ways by Megatron's expert TP, or whole (expert TP 1)
    assert "qwen3_moe-megatron_tp2-vllm_tp4-expert_tp2" in ids and "qwen3_moe-megatron_tp4-vllm_tp1-expert_tp1" in ids
    # the exact matrix: Megatron TP s and vLLM TP t in {1, 2, 4} wherever the heads split;
    # mha / qwen2_bias: every pair (9); gqa / qwen3_tied: 2 KV heads, s in {1, 2} (6); mqa: s = 1 (3);
    # qwen3_moe: expert TP 1 and s for s = 2, 4, only 1 for s = 1: (1 + 2 + 2) x 3 = 15
    # qwen2_5_vl / qwen3_vl: 2 KV heads and 2 vision heads: s in {1, 2}, t in {1, 2} (4); qwen3_vl_moe: those
    # with expert TP 1 and s (s = 1: 1; s = 2: 2) (6)
    per_model = {name: sum(i.startswith(name + "-") for i in ids) for name in MODELS}
    assert per_model == {"mha": 9, "qwen2_bias": 9, "gqa": 6, "qwen3_tied": 6, "mqa": 3, "qwen3_moe": 15,
                         "qwen2_5_vl": 4, "qwen3_vl": 4, "qwen3_vl_moe": 6}, per_model
    assert len(ids) == 62


def test_fused_moe_tensors_stack_experts():
    bridge, _ = model("qwen3_moe")  # 4 experts of width 32, hidden 40; layer 1 dense
    tensors = {t.name.rpartition(".")[2]: t for t in bridge.vllm_tensors(2, 2, 1) if "layers.0.mlp.experts" in t.name}
    w13, w2 = tensors["w13_weight"], tensors["w2_weight"]
    assert w13.name == "model.layers.0.mlp.experts.routed_experts.w13_weight"
    assert w13.shape == (4, 32, 40) and w2.shape == (4, 40, 16)
    # expert e's [gate_r; up_r] rows come from its own Megatron parameter (global expert index)
    assert {p.dest_index for p in w13.pieces} == {(0,), (1,), (2,), (3,)}
    e2 = [p for p in w13.pieces if p.dest_index == (2,)]
    assert {p.source for p in e2} == {"decoder.layers.0.mlp.experts.local_experts.2.linear_fc1.weight"}
    # vLLM rank 1 holds rows 16..31 of gate and up = Megatron TP rank 1's shard, gate then up
    assert [(p.source_tp_rank, p.source_start, p.dest_start, p.length) for p in e2] == [(1, 0, 0, 32)]
    assert not any(t.name.startswith("model.layers.1.mlp.experts") for t in bridge.vllm_tensors(1, 1, 0))


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
    smol = ModelDims(num_layers=1, hidden_size=40, num_attention_heads=8, num_query_groups=2, head_dim=8,
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
    moe, _ = model("qwen3_moe")  # experts of width 32
    with pytest.raises(ValueError, match="parallel.expert_tensor_parallel_size=3 must divide the expert MLP size"):
        moe.check_tp_sizes(1, 1, 3)
