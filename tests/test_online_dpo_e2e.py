"""Online / iterative DPO (``algorithm=online_dpo``) through the real pipeline on a tiny random
Llama under torchrun with 2 processes: vLLM samples, the judge pairs best with worst, DPO steps,
weight sync, the iteration's reference copied from the policy, checkpointed, and resumed
mid-iteration."""

from __future__ import annotations

import math

import pytest
import torch

from tests.conftest import Job, run_jobs
from tests.dist.tiny_llama import save_tiny_hf_dir

pytestmark = pytest.mark.slow  # launches processes: the full suite only (CONTRIBUTING.md, test tiers)

COMMON = ["algorithm=online_dpo", "rollout.prompts_per_step=4", "rollout.group_size=4", "trainer.micro_batch_size=1",
          "data.heldout_size=8", "data.train_size=50", "rollout.max_tokens=16", "rollout.eval_max_tokens=8",
          "trainer.lr=1e-3", "trainer.progress_bar=false", "trainer.export_hf=false",
          "algorithm.ref_update=iteration", "algorithm.iteration_steps=2"]


def _weights(step_dir) -> dict:
    """A Megatron distributed checkpoint's model tensors, read without a process group."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    target = step_dir.parent / f"{step_dir.parent.name}_{step_dir.name}.pt"
    dcp_to_torch_save(str(step_dir), str(target))
    state = torch.load(target, weights_only=False)
    return {k: v for k, v in state.items() if isinstance(v, torch.Tensor) and "optimizer" not in k}


def test_online_dpo_pairs_its_own_samples_updates_the_reference_and_resumes_mid_iteration(tmp_path):
    model_dir = save_tiny_hf_dir(tmp_path / "tiny")
    out = tmp_path / "run"
    # in one launch: 3 steps, then the resume of the last part of this test
    s, resumed = run_jobs(
        Job("grpo", model_dir, out, ["trainer.steps=3", "trainer.save_every=1", "trainer.keep_last=2",
                                     "rollout.check_weight_sync=true", *COMMON], reward="even_length"),
        Job("grpo", model_dir, out, ["trainer.steps=4", "algorithm.loss_type=ipo", *COMMON], reward="even_length",
            result=tmp_path / "resumed.json"))
    history = s["history"]
    for m in history:
        assert 0 < m["online_dpo/pairs"] <= 4 and m["online_dpo/pairs"] == 4 * (1 - m["online_dpo/tie_fraction"])
        assert m["reward/chosen"] == 1.0 and m["reward/rejected"] == 0.0  # even_length is 0/1: best 1, worst 0
        assert m["weight_sync/checked"] == 26.0 and m["grad_norm"] > 0.0
    # the first step of each iteration trains against a reference equal to the policy: every implicit
    # reward is 0, so DPO's loss is exactly log 2; inside an iteration the policy has moved away
    assert [m["online_dpo/ref_version"] for m in history] == [0.0, 0.0, 2.0]
    for m in (history[0], history[2]):
        assert abs(m["dpo/loss"] - math.log(2)) < 1e-6 and abs(m["dpo/margin"]) < 1e-6, m
    assert abs(history[1]["dpo/loss"] - math.log(2)) > 1e-4 and history[1]["dpo/margin"] != 0.0
    # the reference is checkpointed: at step 3 it is the policy of step 2 (the iteration's start)
    ckpt = out / "checkpoints"
    # trainer.keep_last=2 in the first job: step_1 went once step_3 was complete; the resume keeps all
    assert sorted(d.name for d in ckpt.iterdir()) == ["step_2", "step_3", "step_4"]
    ref3, pol2, pol3 = _weights(ckpt / "step_3" / "reference"), _weights(ckpt / "step_2" / "policy"), _weights(
        ckpt / "step_3" / "policy")
    assert ref3.keys() == pol2.keys() and len(ref3) > 0
    assert all(torch.equal(ref3[k], pol2[k]) for k in ref3)
    assert any(not torch.equal(pol3[k], pol2[k]) for k in pol3)

    # resumed mid-iteration (step 3 of the iteration [2, 4)) with IPO: the reference comes back from the
    # checkpoint (version 2): not the policy (version 3; the loss is not IPO's at zero margin), and not the
    # initial weights (the final checkpoint's reference is still step 2's policy)
    assert resumed["start_step"] == 3 and len(resumed["history"]) == 1
    m = resumed["history"][0]
    assert m["online_dpo/ref_version"] == 2.0 and m["grad_norm"] > 0.0
    assert abs(m["dpo/loss"] - (1 / (2 * 0.1)) ** 2) > 1e-3 and m["dpo/margin"] != 0.0, m
    ref4 = _weights(ckpt / "step_4" / "reference")
    assert all(torch.equal(ref4[k], pol2[k]) for k in pol2)
