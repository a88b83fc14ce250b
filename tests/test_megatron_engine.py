"""The ``megatron`` rollout engine (megatron-core's inference engine on the trainer's own model,
alignment/rollout/engines/megatron_engine.py) and the KV-cache attention it needs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from parallel.cached_attention import cached_causal_attention


def test_cached_causal_attention_aligns_the_mask_to_the_last_queries():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 6, 8, generator=g) for _ in range(3))
    full = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.3)
    assert torch.allclose(cached_causal_attention(q, k, v, 0.3), full, atol=1e-6)  # no cache: plain causal
    # the last 2 queries against all 6 keys (a KV cache) = the last 2 rows of the full causal attention
    assert torch.allclose(cached_causal_attention(q[:, :, 4:], k, v, 0.3), full[:, :, 4:], atol=1e-6)
    # one decoded token sees every key (SDPA's top-left is_causal would let it see only the first)
    one = cached_causal_attention(q[:, :, 5:], k, v, 0.3)
    assert torch.allclose(one, full[:, :, 5:], atol=1e-6)
    # grouped-query: 4 query heads over 2 key/value heads
    kv2 = k[:, :2], v[:, :2]
    ref = F.scaled_dot_product_attention(q, kv2[0].repeat_interleave(2, 1), kv2[1].repeat_interleave(2, 1),
                                         is_causal=True, scale=0.3)
    assert torch.allclose(cached_causal_attention(q[:, :, 3:], *kv2, 0.3), ref[:, :, 3:], atol=1e-6)
    # bf16 in, bf16 out, computed in fp32: within one bf16 rounding of the fp32 result, and no
    # further from it than SDPA's own bf16 kernel
    qb, kb, vb = (t.bfloat16() for t in (q[:, :, 5:], *kv2))
    out = cached_causal_attention(qb, kb, vb, 0.3)
    exact = F.scaled_dot_product_attention(qb.float(), kb.float().repeat_interleave(2, 1),
                                           vb.float().repeat_interleave(2, 1), scale=0.3)
    sdpa = F.scaled_dot_product_attention(qb, kb, vb, scale=0.3, enable_gqa=True)
    err = (out.float() - exact).abs().max().item()
    assert out.dtype == torch.bfloat16 and err <= 2**-8 * exact.abs().max().item()
    assert err <= (sdpa.float() - exact).abs().max().item() + 1e-6


@pytest.mark.slow
def test_megatron_engine_matches_transformers(torchrun_json):
    r = torchrun_json("megatron_engine_worker.py", nproc=1)
    assert r["greedy_equal"], r  # 8 greedy tokens of 2 prompts (lengths 5 and 3, one batch) = transformers'
    assert r["greedy_after_vllm_import_equal"], r  # after vLLM's CPU worker rebound torch.cuda.Event
    assert r["eos_stop"], r  # stops at the EOS, returned as the last token with its logprob, finished
    # sampled at T=0.7: every token's logprob is transformers' log softmax(logits / 0.7) (fp32)
    assert r["logprob_max_diff"] < 1e-4, r
    assert r["samples_differ"], r  # no re-seeding per call: the next step samples anew
    assert r["shapes_ok"] and r["train_mode_restored"] and r["sync_is_noop"], r
    # its own RNG stream: the trainer's global RNG is left alone, and the same seed samples the same
    assert r["rng_untouched"] and r["same_seed_same_samples"], r
    # reseed(step): the step's own stream, whatever was sampled before (a resumed run samples alike)
    assert r["reseed_same_stream"] and r["reseed_other_step_differs"], r
    assert r["on_done_after_each_batch"], r  # a prompt's samples handed out as soon as its rows are done
    # sleep frees the whole KV cache (keys + values of every layer), the next generation re-allocates it
    assert r["kv_bytes"] == r["kv_expected"] > 0 and r["kv_after_sleep"] == 0, r
    # its sampler draws from softmax(logits / T): mean drawn logprob = -entropy within 4 standard errors
    assert abs(r["sampled_mean_logprob"] - r["neg_entropy"]) < 4 * r["sampled_logprob_sem"], r
    assert r["drawn_logprob_is_reported"] < 1e-4, r
    # decode steps of fixed shape (the CUDA-graph path, uncaptured on CPU): eager engine's greedy and sampled
    # tokens over 70 new tokens (two 64-position buckets), before and after sleep, logprobs to fp32 rounding
    # alignment/rollout/engines/decode_loop.py generates those batches (sampling and stop checks in the step); a 4th call
    # stops at an EOS id the rows draw part-way: the same responses, cut after the EOS, as Megatron's own loop
    assert r["static_decoder_only_when_asked"] and r["static_loop_used"] and r["static_rows"] == 2 + 4 + 4 + 4, r
    assert r["static_tokens_equal"] and r["static_logprob_max_diff"] < 1e-5, r
    ends = r["static_eos_rows"]
    assert r["static_eos_equal"] and any(f and last for f, _, last in ends) and any(not f for f, _, _ in ends), ends
    assert all(n == 70 for f, n, _ in ends if not f) and all(n < 70 for f, n, _ in ends if f), ends


@pytest.mark.slow
def test_fixed_shape_decode_equals_eager_decode_under_tensor_parallelism(torchrun_json):
    """alignment/rollout/engines/static_decode.py at TP=2 (tests/dist/static_decode_worker.py): the steps a GPU captures
    as CUDA graphs, run uncaptured, against Megatron's eager decode of the same shards."""
    ranks = torchrun_json("static_decode_worker.py", nproc=2)["ranks"]
    assert len(ranks) == 2
    for r in ranks:  # each rank's engines
        for name in ("llama", "qwen3_tied"):  # untied; Q/K layernorms with tied embeddings
            # 3 greedy rows + 6 sampled + 6 sampled after sleep (a new KV cache), 70 new tokens (2 buckets) each
            assert r[name]["static"] and r[name]["rows"] == 15 and r[name]["lengths"] == [70], r
            assert r[name]["tokens_equal"] and r[name]["logprob_max_diff"] < 1e-5, r
        # a mixture-of-experts model decodes eagerly (its dispatcher syncs with the host)
        assert r["moe"] == {"unsupported": "mixture-of-experts layers", "static": False}, r
