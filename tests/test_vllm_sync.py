"""In-memory weight update of a running vLLM engine: afterwards its logprobs equal
transformers' on the new weights, for full HF tensors and for streamed vLLM-layout tensors
(with the weight check, which must catch a swapped pair of query heads, or of experts), for a
tiny Llama, a tiny Qwen3-MoE and tiny Qwen2.5-VL / Qwen3-VL-MoE models generating from images;
reseeding gives a step's own sampling stream. The tied case is a regression test: vLLM 0.32's
in-place reload left the CPU-packed LM head on the old weights (error 0.75)."""

from __future__ import annotations


import pytest

from tests.conftest import run_vllm_worker

pytestmark = pytest.mark.slow  # launches processes: the full suite only (CONTRIBUTING.md, test tiers)


def test_update_weights_reaches_the_engine(tmp_path):
    r = run_vllm_worker("vllm_sync_worker.py", tmp_path)
    # full HF tensors, then vLLM-layout tensors (fused qkv_proj / gate_up_proj) streamed in buckets and
    # checked by the probe, then Qwen3-MoE (fused experts stacked from per-expert Megatron shards, prepacked
    # again by the engine): after the update within 1e-4 of transformers on the new weights; before it,
    # the same comparison is off by more than 1e-3 (negative control: it can fail)
    for case in ("untied", "tied", "resharded_untied", "resharded_tied", "resharded_qwen3_moe"):
        assert r[case]["after"] <= 1e-4 and r[case]["before"] > 1e-3, (case, r[case])
    # prompts with images (multi_modal_data): sampled logprobs == transformers' with the same images; the
    # vision tower's vLLM-split tensors synced (a swapped pair of rows in a tower QKV is caught); afterwards
    # == transformers on the new weights (vLLM's encoder cache dropped: it kept the old tower's embeddings
    # of the same image, 2.3 off), before it 2.2-2.3 off
    assert sorted(r["images"]) == ["qwen2_5_vl", "qwen3_vl_moe"]
    for family, c in r["images"].items():
        tower, every = {"qwen2_5_vl": (26, 56), "qwen3_vl_moe": (45, 83)}[family]
        assert c["prompt_tokens"] == 39 and c["images_kept"] == [True, True, False, False], (family, c)
        assert c["caught"] and c["checked"] == every and c["tower_tensors"] == tower, (family, c)
        assert c["start"] <= 1e-4 and c["after"] <= 1e-4 and c["before"] > 1e-2, (family, c)
    # reseed(step) starts the step's own stream whatever was sampled before, leaving the trainer's
    # random state alone (tests/test_kill_resume.py: a resumed run samples as the uninterrupted one)
    assert all(r["reseed"].values()), r["reseed"]
    # on_done hands each prompt's samples out as vLLM finishes them, the first while others still
    # generate; the samples are LLM.generate's own for the same random state
    order = r["streaming"].pop("order")
    assert all(r["streaming"].values()) and sorted(order) == [0, 1, 2, 3, 4], (r["streaming"], order)
