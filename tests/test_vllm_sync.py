"""In-memory weight update of a running vLLM engine: afterwards its logprobs equal
transformers' on the new weights, for full HF tensors and for streamed vLLM-layout tensors
(with the weight check, which must catch a swapped pair of query heads, or of experts), for a
tiny Llama and a tiny Qwen3-MoE; reseeding gives a step's own sampling stream. The tied case is a regression test: vLLM 0.32's
in-place reload left the CPU-packed LM head on the old weights (error 0.75)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.slow  # launches processes: the full suite only (CONTRIBUTING.md, test tiers)


def test_update_weights_reaches_the_engine(tmp_path):
    result = tmp_path / "sync.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
           "VLLM_CPU_KVCACHE_SPACE": "1"}
    proc = subprocess.run([sys.executable, str(ROOT / "tests/dist/vllm_sync_worker.py"), str(tmp_path), str(result)],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]
    r = json.loads(result.read_text())
    assert r["untied"] <= 1e-4, r
    assert r["tied"] <= 1e-4, r
    # vLLM-layout tensors (fused qkv_proj / gate_up_proj) streamed in buckets, checked by the probe
    assert r["resharded_untied"] <= 1e-4, r
    assert r["resharded_tied"] <= 1e-4, r
    # Qwen3-MoE: fused experts stacked from per-expert Megatron shards, prepacked again by the engine
    assert r["resharded_qwen3_moe"] <= 1e-4, r
    # reseed(step) starts the step's own stream whatever was sampled before, leaving the trainer's
    # random state alone (tests/test_kill_resume.py: a resumed run samples as the uninterrupted one)
    assert all(r["reseed"].values()), r["reseed"]
