"""Rejection-sampling fine-tuning (``algorithm=rft``) through the real pipeline on a tiny random
Llama under torchrun with 2 processes: vLLM samples, the grader filters, one SFT step per
iteration, weights synced into the engine, checkpoints and resume."""

from __future__ import annotations


import pytest

from tests.conftest import Job, run_jobs
from tests.dist.tiny_llama import save_tiny_hf_dir

pytestmark = pytest.mark.slow  # launches processes: the full suite only (CONTRIBUTING.md, test tiers)

COMMON = ["algorithm=rft", "rollout.prompts_per_step=4", "rollout.group_size=4", "trainer.micro_batch_size=2",
          "data.heldout_size=8", "data.train_size=50", "rollout.max_tokens=16", "rollout.eval_max_tokens=8",
          "trainer.lr=1e-3", "trainer.progress_bar=false", "trainer.export_hf=false"]


def test_rft_iterations_filter_fine_tune_and_resume(tmp_path):
    model_dir = save_tiny_hf_dir(tmp_path / "tiny")
    out = tmp_path / "run"
    # in one launch: 2 steps, then a resume at step 2 with STaR's rationalisation and a grader that
    # accepts only answers to hinted prompts: every problem fails, is asked again with its answer as
    # a hint, and is solved that way. Temperature 1 in the first: the engine samples from the policy
    # itself, so the trainer's NLL of the kept answers before the step is the engine's NLL of them (fp32)
    s, resumed = run_jobs(
        Job("grpo", model_dir, out, ["trainer.steps=2", "rollout.temperature=1.0", "rollout.check_weight_sync=true",
                                     *COMMON], reward="even_length"),
        Job("grpo", model_dir, out, ["trainer.steps=3", "algorithm.rationalize=true", *COMMON], reward="hint_only",
            result=tmp_path / "resumed.json"))
    first, second = s["history"]
    for m in (first, second):
        # the grader is 0/1 and the threshold 1: the acceptance rate is the mean correctness of all samples
        assert abs(m["rft/acceptance_rate"] - m["reward/correctness"]) < 1e-6 and m["reward/mean"] == m[
            "reward/correctness"], m
        assert 0 < m["rft/kept"] <= m["rft/acceptance_rate"] * 16 + 1e-6  # distinct accepted answers only
        assert m["reward/kept_mean"] == 1.0 and 0 < m["rft/solved_fraction"] <= 1.0
        assert m["rft/rationalized_fraction"] == 0.0 and m["grad_norm"] > 0.0
        assert abs(m["loss/sft"] - m["rft/sampler_nll"]) < 1e-4 * max(1.0, m["loss/sft"]), m
        assert m["weight_sync/checked"] == 26.0  # the fine-tuned weights reached every engine parameter
    assert "kl" not in first and (out / "checkpoints" / "step_2" / "metadata.json").exists()
    assert 0.0 <= s["heldout_accuracy_before"] <= 1.0 and 0.0 <= s["heldout_accuracy_after"] <= 1.0
    assert resumed["start_step"] == 2 and len(resumed["history"]) == 1
    m = resumed["history"][0]
    assert m["rft/acceptance_rate"] == 0.0 and m["reward/correctness"] == 0.0  # the unhinted samples
    assert m["rft/rationalized_fraction"] == 1.0 and m["rft/solved_fraction"] == 1.0
    assert 4 <= m["rft/kept"] <= 16 and m["grad_norm"] > 0.0 and m["loss/sft"] > 0.0
    assert (out / "checkpoints" / "step_3" / "metadata.json").exists()
