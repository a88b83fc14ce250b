"""Layout planning: the memory estimate (:mod:`parallel.memory`) by hand on a tiny config and
against real CPU training steps, the enumeration and recommendation (:mod:`parallel.plan`),
and the CLI (``tools/plan_layout.py``)."""

from __future__ import annotations

import json

import pytest

from alignment.models.dims import ModelDims
from alignment.models.families import model_dims
from parallel.layout import ParallelLayout
from parallel.memory import (
    GiB,
    RolloutPlan,
    estimate_memory,
    kv_cache_bytes,
    layer_activation_bytes,
    lora_layer_parameters,
    logits_bytes,
    microbatches_in_flight,
    stage_memory,
    stage_parameters,
)
from parallel.plan import enumerate_layouts, plan, recommend
from tools.plan_layout import load_model_config, main

# tests/dist/tiny_llama.py's model: 4 layers, H 64, 4 heads / 2 KV heads of 32, MLP 80, vocabulary 250
# (padded to 256 at TP 1 and 2).
TINY = dict(num_layers=4, hidden_size=64, num_attention_heads=4, num_query_groups=2, head_dim=32,
            ffn_hidden_size=80, vocab_size=250)
LAYER_TP1 = 256 * 64 + 64 * 128 + 160 * 64 + 64 * 80 + 2 * 64  # qkv (4+2+2 heads x 32), proj, fc1, fc2, 2 norms
LAYER_TP2 = 128 * 64 + 64 * 64 + 80 * 64 + 64 * 40 + 2 * 64  # the same split over 2 ranks; norms replicated
EMB_TP1, EMB_TP2 = 256 * 64, 128 * 64


def tiny(tied: bool = False, vocab: int = 250) -> ModelDims:
    return ModelDims(**{**TINY, "vocab_size": vocab}, tie_word_embeddings=tied)


def layout(world=1, tp=1, pp=1, cp=1, sp=False, vpp=None) -> ParallelLayout:
    return ParallelLayout(world_size=world, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                          context_parallel_size=cp, sequence_parallel=sp, virtual_pipeline_model_parallel_size=vpp)


def test_parameters_per_stage_by_hand():
    assert LAYER_TP1 == 40064 and LAYER_TP2 == 20096
    assert stage_parameters(tiny(), 1, 1, 0) == 4 * LAYER_TP1 + EMB_TP1 + 64 + EMB_TP1  # embedding, final norm, output
    assert stage_parameters(tiny(tied=True), 1, 1, 0) == 4 * LAYER_TP1 + EMB_TP1 + 64  # one tensor for both
    assert stage_parameters(tiny(tied=True), 2, 1, 0) == 4 * LAYER_TP2 + EMB_TP2 + 64
    # PP=2, tied: the last stage keeps its own copy of the embedding as output layer (Megatron's shared_embedding)
    assert stage_parameters(tiny(tied=True), 1, 2, 0) == 2 * LAYER_TP1 + EMB_TP1
    assert stage_parameters(tiny(tied=True), 1, 2, 1) == 2 * LAYER_TP1 + 64 + EMB_TP1
    assert stage_parameters(tiny(), 2, 2, 1) == 2 * LAYER_TP2 + 64 + EMB_TP2
    # a real model: Llama-3.1-8B has 8,030,261,248 parameters (its model card's 8.03B)
    dims = model_dims(load_model_config("llama-3.1-8b"))
    assert stage_parameters(dims, 1, 1, 0) == 8_030_261_248


def test_qwen3_parameter_counts_by_hand():
    """The shipped Qwen3 configs, counted tensor by tensor (model cards: Qwen3-8B 8.2B parameters,
    6.95B without embeddings; Qwen3-1.7B 1.7B, 1.4B without; Qwen3-30B-A3B 30.5B total, 3.3B activated)."""
    from alignment.models.flops import matmul_params

    d8 = model_dims(load_model_config("qwen3-8b"))  # 36 layers, H 4096, 32 heads / 8 KV of 128, MLP 12288
    layer = 4096 * 4096 + 2 * 1024 * 4096 + 4096 * 4096 + 2 * 128 + 3 * 12288 * 4096 + 2 * 4096  # q, kv, o, QK-norms
    assert layer == 192_946_432
    assert stage_parameters(d8, 1, 1, 0) == 36 * layer + 2 * 151936 * 4096 + 4096 == 8_190_735_360
    d17 = model_dims(load_model_config("qwen3-1.7b"))  # 28 layers, H 2048, 16 heads / 8 KV of 128, MLP 6144, tied
    layer = 2048 * 2048 + 2 * 1024 * 2048 + 2048 * 2048 + 2 * 128 + 3 * 6144 * 2048 + 2 * 2048
    assert stage_parameters(d17, 1, 1, 0) == 28 * layer + 151936 * 2048 + 2048 == 1_720_574_976  # card: 1.7B
    moe = model_dims(load_model_config("qwen3-30b-a3b"))  # 48 layers, H 2048, 32 heads / 4 KV of 128, 128 x 768
    attention = 4096 * 2048 + 2 * 512 * 2048 + 2048 * 4096 + 2 * 128 + 2 * 2048
    expert = 3 * 768 * 2048
    total = 48 * (attention + 128 * 2048 + 128 * expert) + 2 * 151936 * 2048 + 2048
    assert stage_parameters(moe, 1, 1, 0) == total == 30_532_122_624
    # EP=8: each rank keeps 16 of the 128 experts of every layer, everything else
    assert stage_parameters(moe, 1, 1, 0, ep=8, etp=1) == total - 48 * 112 * expert == 5_164_972_032
    # active per token: router + 8 experts instead of 128; + the input embedding and the norms = 3.35B
    active = matmul_params(moe) + 151936 * 2048 + 48 * (2 * 128 + 2 * 2048) + 2048
    assert active == 48 * (attention + 128 * 2048 + 8 * expert) + 2 * 151936 * 2048 + 2048 == 3_353_032_704


def test_weights_grads_adam_bytes_by_hand():
    n = 4 * LAYER_TP1 + 2 * EMB_TP1 + 64  # 193,088 parameters
    kw = dict(micro_batch_size=2, seq_length=16)
    m = stage_memory(tiny(), layout(), 0, dtype="float32", distributed_optimizer=False, **kw)
    assert m.weights == 4 * n
    assert m.grads == 4 * n + 4 * EMB_TP1  # fp32 main-grad buffer + the transient grad of the largest weight
    assert m.optimizer == m.optimizer_plain == 8 * n  # exp_avg + exp_avg_sq; fp32 weights are their own master
    m = stage_memory(tiny(), layout(world=4), 0, dtype="bfloat16", distributed_optimizer=False, **kw)
    assert (m.weights, m.grads) == (2 * n, 4 * n + 2 * EMB_TP1)  # grads stay fp32 (grad_reduce_in_fp32)
    assert m.optimizer == 12 * n  # + fp32 master copy
    assert m.optimizer_distributed == 12 * n // 4  # sharded over DP = 4
    m = stage_memory(tiny(), layout(world=4, cp=2), 0, dtype="bfloat16", distributed_optimizer=True, **kw)
    assert m.optimizer == m.optimizer_distributed == 12 * n // 4  # sharded over DP x CP = 2 x 2
    m = stage_memory(tiny(), layout(world=2, tp=2), 0, dtype="bfloat16", distributed_optimizer=True, **kw)
    assert m.weights == 2 * (4 * LAYER_TP2 + 2 * EMB_TP2 + 64) and m.optimizer == m.optimizer_plain  # DP = 1


def test_lora_adapters_gradients_and_adam_by_hand():
    """``--lora-rank``: adapters add to the weights; gradients and Adam state are the adapters' alone."""
    r = 8
    # qkv: A [8, 64] + B [256, 8]; proj: A [8, 128] + B [64, 8]; fc1: A [8, 64] + B [160, 8]; fc2: A [8, 80] + B [64, 8]
    per_layer_tp1 = (8 * 64 + 256 * 8) + (8 * 128 + 64 * 8) + (8 * 64 + 160 * 8) + (8 * 80 + 64 * 8)
    assert lora_layer_parameters(tiny(), 1, r) == per_layer_tp1 == 7040
    # TP 2: column-parallel B and row-parallel A halve, the other factor whole
    assert lora_layer_parameters(tiny(), 2, r) == (8 * 64 + 128 * 8) + (8 * 64 + 64 * 8) + (8 * 64 + 80 * 8) + (
        8 * 40 + 64 * 8)
    assert lora_layer_parameters(tiny(), 1, r, ("linear_qkv",)) == 8 * 64 + 256 * 8
    n, a = 4 * LAYER_TP1 + 2 * EMB_TP1 + 64, 4 * per_layer_tp1
    m = stage_memory(tiny(), layout(world=4), 0, dtype="bfloat16", distributed_optimizer=False, micro_batch_size=2,
                     seq_length=16, lora_rank=r)
    assert m.weights == 2 * (n + a) and m.grads == a * (4 + 2)  # fp32 main grads + a transient bf16 grad, adapters only
    assert m.optimizer == 12 * a and m.optimizer_distributed == 12 * a // 4
    full = stage_memory(tiny(), layout(world=4), 0, dtype="bfloat16", distributed_optimizer=False, micro_batch_size=2,
                        seq_length=16)
    assert m.activations == full.activations and m.total < full.total


def test_lora_expert_adapters_by_hand():
    """An MoE layer's adapters: attention as a dense layer's, plus each local expert's
    ``linear_fc1`` / ``linear_fc2`` adapters (tiny Qwen3-MoE: H 64, 4 experts of width 48)."""
    from alignment.models.families import model_dims
    from tests.dist.tiny_models import tiny_qwen3_moe_config

    d, r = model_dims(tiny_qwen3_moe_config()), 8  # layers 0-2 sparse, layer 3 dense (width 80)
    attention = (8 * 64 + (4 + 2 * 2) * 32 * 8) + (8 * 128 + 64 * 8)  # qkv + proj
    expert = (8 * 64 + 96 * 8) + (8 * 48 + 64 * 8)  # fc1: A [8, 64] + B [96, 8]; fc2: A [8, 48] + B [64, 8]
    assert lora_layer_parameters(d, 1, r, moe=True, ep=2) == attention + 2 * expert == 8448
    assert lora_layer_parameters(d, 1, r, moe=True, ep=2, experts_only=True) == 2 * expert
    # expert TP 2 halves B of fc1 and A of fc2
    assert lora_layer_parameters(d, 2, r, moe=True, experts_only=True) == 4 * ((8 * 64 + 48 * 8) + (8 * 24 + 64 * 8))
    assert lora_layer_parameters(d, 1, r, ("mlp.linear_fc1",), moe=True) == 0  # dense MLPs only
    assert lora_layer_parameters(d, 1, r, ("experts.linear_fc2",), moe=True, ep=4) == 8 * 48 + 64 * 8
    assert lora_layer_parameters(d, 1, r, ("experts.linear_fc2",)) == 0  # a dense layer has no experts
    ep2 = ParallelLayout(world_size=2, expert_model_parallel_size=2)  # DP 2, expert DP 1
    m = stage_memory(d, ep2, 0, dtype="bfloat16", distributed_optimizer=True, micro_batch_size=1, seq_length=8,
                     lora_rank=r)
    dense_part = 4 * attention + (8 * 64 + 160 * 8) + (8 * 80 + 64 * 8)  # attention everywhere + layer 3's MLP
    assert m.optimizer_plain == 12 * (dense_part + 3 * 2 * expert)
    assert m.optimizer_distributed == 12 * dense_part // 2 + 12 * 3 * 2 * expert  # experts' state not split


def test_activations_and_logits_by_hand():
    # per token and layer (elements): norms 6 H = 384, attention 256 (qkv) + 128 (q) + 64 (k) + 128 (out) = 576,
    # MLP 5 F = 400; plus the fp32 log-sum-exp, 4 heads x 4 bytes
    tokens = 2 * 16
    assert layer_activation_bytes(tiny(), tokens, 1, False, "float32") == tokens * ((384 + 576 + 400) * 4 + 16)
    assert layer_activation_bytes(tiny(), tokens, 2, True, "bfloat16") == tokens * ((384 + 576 + 400) // 2 * 2 + 8)
    assert layer_activation_bytes(tiny(), tokens, 2, False, "float32") == tokens * ((384 + (576 + 400) // 2) * 4 + 8)
    # logits [32, 256] and their gradient in the weights' dtype, plus two fp32 chunks of the
    # chunked log-softmax (all 32 tokens fit in one chunk here; SmolLM2's vocabulary: 341 tokens)
    assert logits_bytes(tiny(), tokens, 1, "float32") == tokens * 256 * (2 * 4 + 2 * 4)
    assert logits_bytes(tiny(), tokens, 1, "bfloat16") == tokens * 256 * (2 * 2 + 2 * 4)
    big = 4096
    assert logits_bytes(tiny(vocab=49152), big, 1, "bfloat16") == big * 49152 * 4 + 2 * 4 * 341 * 49152
    m = stage_memory(tiny(), layout(), 0, dtype="float32", micro_batch_size=2, seq_length=16,
                     distributed_optimizer=False)
    assert m.activations == 4 * tokens * (1360 * 4 + 16) + 3 * 64 * tokens * 4  # 4 layers + the final norm
    assert m.logits == tokens * 256 * 16
    # context parallelism splits the tokens
    m2 = stage_memory(tiny(), layout(world=2, cp=2), 0, dtype="float32", micro_batch_size=2, seq_length=16,
                      distributed_optimizer=False)
    assert (m2.activations, m2.logits) == (m.activations // 2, m.logits // 2)


def test_pipeline_microbatches_in_flight():
    assert [microbatches_in_flight(4, s) for s in range(4)] == [4, 3, 2, 1]  # 1F1B warm-up
    assert microbatches_in_flight(4, 0, num_microbatches=2) == 2
    assert microbatches_in_flight(1, 0) == 1
    # interleaved, 2 chunks: (pp-1)*2 + (vpp-1)*pp + 1 = 11 chunk-micro-batches of L/8 layers = L (1 + 3/8)
    assert microbatches_in_flight(4, 0, vpp=2) == 11
    # the first stage of PP=2 holds 2 micro-batches of half the layers: as much as PP=1, plus the stage outputs
    one = estimate_memory(tiny(), layout(), dtype="float32", micro_batch_size=2, seq_length=16)
    first = stage_memory(tiny(), layout(world=2, pp=2), 0, dtype="float32", micro_batch_size=2, seq_length=16,
                         distributed_optimizer=False)
    final_norm = 3 * 64 * 32 * 4
    assert first.activations == one.activations - final_norm + 2 * 32 * 64 * 4


def test_kv_cache_and_rollout():
    dims = model_dims(load_model_config("llama-3.1-8b"))
    # 2 x 32 layers x 8 KV heads x 128 x 2 bytes = 128 KiB per token
    assert kv_cache_bytes(dims, 1, 1, "bfloat16") == 131072
    assert kv_cache_bytes(dims, 1000, 4, "bfloat16") == 131072 * 1000 // 4
    assert kv_cache_bytes(dims, 1, 16, "bfloat16") == 131072 // 8  # 8 KV heads over 16 ranks: one replicated head
    m = estimate_memory(dims, layout(world=8, tp=8), rollout=RolloutPlan(8, 32768, "bfloat16"))
    assert m.kv_cache == 131072 * 32768 // 8
    assert m.rollout_weights == pytest.approx(2 * 8_030_261_248 / 8, rel=1e-3)
    assert m.total == sum(v for k, v in m.as_dict().items() if k not in ("stage", "total", "optimizer_plain",
                                                                         "optimizer_distributed"))


def test_enumeration_8_gpus():
    """8 heads / 2 KV heads, 6 layers, 2 nodes x 4 GPUs."""
    dims = ModelDims(num_layers=6, hidden_size=256, num_attention_heads=8, num_query_groups=2, head_dim=32,
                     ffn_hidden_size=512, vocab_size=1000, tie_word_embeddings=False)
    valid, refused = enumerate_layouts(dims, nodes=2, gpus_per_node=4, seq_length=4096)
    got = {(x.tensor_model_parallel_size, x.pipeline_model_parallel_size, x.context_parallel_size,
            x.data_parallel_size) for x in valid}
    assert got == {(1, 1, 1, 8), (1, 1, 2, 4), (1, 1, 4, 2), (1, 1, 8, 1), (1, 2, 1, 4), (1, 2, 2, 2), (1, 2, 4, 1),
                   (2, 1, 1, 4), (2, 1, 2, 2), (2, 1, 4, 1), (2, 2, 1, 2), (2, 2, 2, 1)}
    assert all(x.sequence_parallel == (x.tensor_model_parallel_size > 1) for x in valid)
    why = {(r.tp, r.pp, r.cp): r.reason for r in refused}
    assert set(why) == {(1, 4, 1), (1, 4, 2), (1, 8, 1), (2, 4, 1), (4, 1, 1), (4, 1, 2), (4, 2, 1), (8, 1, 1)}
    assert "spans nodes" in why[(8, 1, 1)]
    assert "2 KV heads" in why[(4, 1, 1)] and "tensor_model_parallel_size=4" in why[(4, 1, 1)]
    assert "6 layers" in why[(1, 4, 1)] and "6 layers" in why[(2, 4, 1)]
    _, refused = enumerate_layouts(dims, nodes=2, gpus_per_node=4, seq_length=12)
    assert any(r.cp == 4 and "2 x CP" in r.reason for r in refused)  # 12 tokens cannot be zig-zagged over 4


def test_recommendation_llama_8b_one_node():
    """Llama-3.1-8B, 1 x 8 x 80 GiB, bf16, micro-batch 1 x 4096: without the distributed optimizer the Adam
    state (12 bytes/param) needs TP=4 to fit 72 GiB; with it, TP=2 (Adam / 4 DP ranks) fits."""
    dims = model_dims(load_model_config("llama-3.1-8b"))
    kw = dict(nodes=1, gpus_per_node=8, gpu_memory_bytes=80 * GiB, dtype="bfloat16", seq_length=4096)
    for dist_opt, want in ((False, (4, 1, 1, 2)), (True, (2, 1, 1, 4))):
        candidates, _ = plan(dims, distributed_optimizer=dist_opt, **kw)
        best = recommend(candidates)
        lay = best.layout
        assert (lay.tensor_model_parallel_size, lay.pipeline_model_parallel_size, lay.context_parallel_size,
                lay.data_parallel_size) == want
        assert best.memory.total <= 0.9 * 80 * GiB
        # nothing with less model parallelism fits
        assert not [c for c in candidates if c.fits and c.layout.model_parallel_size < lay.model_parallel_size]
    candidates, _ = plan(model_dims(load_model_config("llama-3.1-70b")), nodes=1, gpus_per_node=8,
                         gpu_memory_bytes=24 * GiB)
    assert recommend(candidates) is None  # 70B does not fit 8 x 24 GiB


def test_cli(tmp_path, capsys):
    main(["--model", "llama-3.1-8b", "--nodes", "2", "--gpus-per-node", "8", "--gpu-memory-gib", "80"])
    out = capsys.readouterr().out
    assert "recommended: TP=4 PP=1 CP=1 DP=4 (sequence parallel)" in out
    assert "with --distributed-optimizer: TP=2 PP=1 CP=1 DP=8" in out
    assert "TP=16 PP=1 CP=1: TP=16 spans nodes" in out
    # an HF directory (the tiny model's config.json), with a vLLM engine
    from tests.dist.tiny_llama import tiny_llama_config

    tiny_llama_config().save_pretrained(tmp_path)
    candidates, refused, best = main(["--model", str(tmp_path), "--nodes", "1", "--gpus-per-node", "2",
                                      "--gpu-memory-gib", "1", "--dtype", "float32", "--seq-length", "64",
                                      "--rollout-tp", "2", "--kv-cache-tokens", "4096"])
    assert len(candidates) == 4 and not refused  # (TP, PP, CP) = (1,1,1), (1,1,2), (1,2,1), (2,1,1)
    assert best.layout.data_parallel_size == 2 and best.memory.kv_cache == kv_cache_bytes(tiny(), 4096, 2, "float32")
    assert "KV cache" in capsys.readouterr().out


@pytest.mark.parametrize("argv, flag", [
    (["--model", "no-such-model"], "--model no-such-model: not found; expected a shipped config (llama-3.1-70b"),
    (["--model", "llama-3.1-8b", "--rollout-tp", "3"], "--rollout-tp 3: must divide --gpus-per-node 8"),
    (["--model", "llama-3.1-8b", "--dtype", "fp16"], "--dtype fp16: valid values are float32, bfloat16"),
    (["--model", "llama-3.1-8b", "--kv-cache-tokens", "10"], "needs --rollout-tp"),
    (["--model", "llama-3.1-8b", "--gpu-memory-gib", "0"], "--gpu-memory-gib 0.0: must be > 0"),
])
def test_cli_errors_name_the_flag(argv, flag, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2 and flag in capsys.readouterr().err


def test_smollm2_from_its_gguf():
    dims = model_dims(load_model_config("smollm2"))
    assert (dims.num_layers, dims.num_attention_heads, dims.num_query_groups) == (30, 9, 3)
    assert dims.tie_word_embeddings
    assert stage_parameters(dims, 1, 1, 0) == 134_515_008  # SmolLM2-135M
    valid, refused = enumerate_layouts(dims, nodes=1, gpus_per_node=2, seq_length=512)
    assert len(valid) == 3 and [(r.tp, r.pp, r.cp) for r in refused] == [(2, 1, 1)]  # 9 heads: no TP=2


@pytest.mark.heavy(cheap="tests/test_plan_layout.py::test_weights_grads_adam_bytes_by_hand")
def test_estimate_matches_measured_peak_rss(torchrun_json):
    """Real CPU training steps (2 processes, fp32, ~32M parameters; ``tests/dist/memory_worker.py``) at DP=2
    (each rank holds what a single process would: measured 773.6-773.9 vs 774.5 MiB), DP=2 with the distributed
    optimizer, TP=2 and PP=2 (2 micro-batches in flight on the first stage).

    Exact: the parameters, gradient buffer and Adam state of every rank (and of a tied-embedding model).
    Close: the activations autograd saved in one forward (within 3 %: RoPE's cos/sin and the token ids
    are not counted) and the rise of peak RSS over the RSS before the model was built, within 15 %
    (measured -1.8 % to +4.3 %: allocator rounding, the micro-batch tensors, gloo buffers, RoPE caches,
    Python objects). ``MALLOC_MMAP_THRESHOLD_`` pins glibc's mmap threshold: with its default dynamic
    threshold, freed activation blocks stay in the heap and RSS overstates the live tensors (measured
    +38 % for one process: 1023 MiB for an estimate of 742), which is the host allocator, not the model.
    """
    from transformers import LlamaConfig

    from tests.dist.memory_worker import CONFIG, MICRO_BATCH, MICROBATCHES, SEQ

    res = torchrun_json("memory_worker.py", "1:1:0,1:1:1,2:1:0,1:2:0", env={"MALLOC_MMAP_THRESHOLD_": "65536"})
    dims = model_dims(LlamaConfig(**CONFIG))
    ratios = {}
    for spec, ranks in res.items():
        tp, pp, dist_opt = (int(x) for x in spec.split(":"))
        lay = layout(world=2, tp=tp, pp=pp)
        for r in ranks:
            stage = r["pp_stage"]
            est = stage_memory(dims, lay, stage, dtype="float32", micro_batch_size=MICRO_BATCH, seq_length=SEQ,
                               distributed_optimizer=bool(dist_opt), num_microbatches=MICROBATCHES)
            assert r["params"] == stage_parameters(dims, tp, pp, stage)
            assert r["tiny_tied_params"] == stage_parameters(tiny(tied=True), tp, pp, stage)
            assert r["grad_buffer"] == r["params"]  # no padding: the buffer is a multiple of 128 x DP here
            assert 4 * r["adam_state"] == est.optimizer
            if r["saved_activations"] is not None:
                assert 1.0 <= r["saved_activations"] / est.activations <= 1.03
            ratios[f"{spec}/stage{stage}/tp{r['tp_rank']}"] = r["peak_increase"] / est.total
    assert all(0.85 <= x <= 1.15 for x in ratios.values()), json.dumps(ratios, indent=1)


def test_moe_layouts_shard_experts_and_their_adam_state():
    """Qwen3-30B-A3B on 8 x 80 GiB: every layout is planned at each expert-parallel size; EP=8 keeps
    16 of 128 experts per rank, and the distributed optimizer shards expert Adam state over the
    expert-data-parallel ranks (8 / EP) instead of DP x CP. No layout fits without EP."""
    moe = model_dims(load_model_config("qwen3-30b-a3b"))
    candidates, _ = plan(moe, nodes=1, gpus_per_node=8, gpu_memory_bytes=80 * GiB, distributed_optimizer=True,
                         dtype="bfloat16", seq_length=4096)
    by = {(c.layout.tensor_model_parallel_size, c.layout.pipeline_model_parallel_size,
           c.layout.context_parallel_size, c.layout.expert_model_parallel_size): c.memory for c in candidates}
    expert = 3 * 768 * 2048
    ep1, ep8 = by[(1, 1, 1, 1)], by[(1, 1, 1, 8)]  # DP = 8
    assert ep1.weights - ep8.weights == 48 * 112 * expert * 2  # bf16
    # Adam 12 bytes/param: dense over DP x CP = 8 ranks; experts over expert DP = 8 (EP 1) or 1 (EP 8)
    dense = stage_parameters(moe, 1, 1, 0) - 48 * 128 * expert
    assert ep1.optimizer == -(-dense * 12 // 8) + -(-48 * 128 * expert * 12 // 8)
    assert ep8.optimizer == -(-dense * 12 // 8) + 48 * 16 * expert * 12
    best = recommend(candidates)
    assert best.layout.expert_model_parallel_size == 8 and best.layout.expert_tensor_parallel_size == 1
    assert not any(c.fits for c in candidates if c.layout.expert_model_parallel_size == 1)


def test_cli_plans_a_moe_model(capsys):
    main(["--model", "qwen3-30b-a3b", "--nodes", "1", "--gpus-per-node", "8", "--distributed-optimizer"])
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if "TP" in line and "PP" in line and "DP" in line)
    assert "EP" in header.split("DP")[1]  # an EP column after DP
    assert "recommended: TP=4 PP=1 CP=2 DP=1 EP=8 (expert TP 1)" in out
