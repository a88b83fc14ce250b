"""PPO with a critic through the real pipeline (policy + reference + critic + reward model in
Megatron, vLLM rollouts, GAE, several epochs of mini-batch updates, weight sync, policy and
critic checkpoints, resume) on a tiny random Llama under torchrun with 2 processes."""

from __future__ import annotations

import math

import pytest

from tests.conftest import Job, run_jobs
from tests.dist.tiny_llama import save_tiny_hf_dir

pytestmark = pytest.mark.slow  # launches processes: the full suite only (CONTRIBUTING.md, test tiers)

ARGS = ["rollout.prompts_per_step=4", "trainer.micro_batch_size=1", "algorithm.num_mini_batches=2",
        "algorithm.ppo_epochs=2", "data.heldout_size=4", "data.train_size=16", "rollout.max_tokens=12",
        "trainer.lr=1e-3", "trainer.critic_lr=1e-3", "trainer.progress_bar=false", "trainer.export_hf=false"]


@pytest.fixture(scope="module")
def first_runs(tmp_path_factory) -> dict:
    """The two tests' first jobs, in one launch."""
    root = tmp_path_factory.mktemp("ppo")
    model_dir = save_tiny_hf_dir(root / "tiny")
    jobs = {"ppo": Job("ppo", model_dir, root / "run",
                       [f"model.reward_model_path={model_dir}", *ARGS, "trainer.steps=2",
                        "reward.functions=[{name: reward_model}, {name: length, weight: 0.1}]"]),
            "multi_turn": Job("ppo", model_dir, root / "multi_turn",
                              [f"model.critic_path={model_dir}", "model.reward_model_path=''", *ARGS,
                               "trainer.steps=2", "data.task=arithmetic",
                               "reward.functions=[{name: correctness}, {name: environment, weight: 0.5}]",
                               "rollout.environment=tests.dist.echo_env:build", "rollout.max_turns=3",
                               "rollout.max_tokens=64", "rollout.max_tokens_per_turn=6", "rollout.eval_max_tokens=6",
                               "algorithm.target_kl=1e-9"])}
    run_jobs(*jobs.values())
    return jobs


def test_ppo_steps_update_policy_and_critic_and_resume(first_runs):
    first_job = first_runs["ppo"]
    s, out, model_dir = first_job.summary(), first_job.out, first_job.model
    first, second = s["history"]
    for m in (first, second):
        # the composite reward: the reward model's score plus 0.1 x the length penalty, each logged
        assert -1.0 <= m["reward/length"] < 0.0 and m["reward/reward_model"] != 0.0
        assert abs(m["reward/mean"] - (m["reward/reward_model"] + 0.1 * m["reward/length"])) < 1e-5, m
        # the engine sampled with the trainer's current weights (synced after step 1)
        assert 1.0 <= m["token_mult_prob_error"] < 1.0 + 1e-4, m
        assert 0.0 <= m["rollout_correction/kl"] < 1e-6, m  # the mismatch metrics: no gap in fp32
        assert m["clip_fraction"] > 0.0  # later mini-batches/epochs move the ratio away from 1
        assert m["ppo/policy_updates"] == 4.0 and m["health/skipped_updates"] == 0.0  # 2 epochs x 2 mini-batches
        assert m["loss/value"] > 0.0 and math.isfinite(m["explained_variance"]) and m["grad_norm"] > 0.0
    assert first["kl"] == 0.0 and second["kl"] != 0.0  # the policy moved away from the reference
    h = s["heldout"]
    assert h["prompts"] == 4 and 0.0 <= h["win_rate"] <= 1.0 and h["length_before"] > 0
    assert (out / "checkpoints" / "step_2" / "policy" / "metadata.json").exists()
    assert (out / "checkpoints" / "step_2" / "critic" / "metadata.json").exists()
    # in one launch, two resumes: with the four models offloaded between phases (forced on CPU: the
    # same copies as on GPU), in another layout: every sequence split over both ranks (ring CP=2,
    # DP=1), packed; the policy, reference, critic and reward model all run through
    # context-parallel attention. Then one more step with rollout.backend=megatron (DP=2):
    # megatron-core's engine samples from the resumed policy itself, nothing synced; the win
    # rate's baseline is still the initial policy's responses.
    common = [f"model.reward_model_path={model_dir}", *ARGS]
    resumed, last = run_jobs(
        Job("ppo", model_dir, out, [*common, "trainer.steps=3", "trainer.offload=true",
                                    "parallel.context_parallel_size=2", "trainer.sequence_packing=true"],
            env={"MEGALIGN_OFFLOAD_ON_CPU": "1"}, result=out.parent / "resumed.json"),
        Job("ppo", model_dir, out, [*common, "trainer.steps=4", "rollout.backend=megatron"],
            result=out.parent / "last.json"))
    assert resumed["start_step"] == 2 and len(resumed["history"]) == 1
    m = resumed["history"][0]
    assert 1.0 <= m["token_mult_prob_error"] < 1.0 + 1e-4  # the engine got the resumed (and reloaded) policy
    assert m["clip_fraction"] > 0.0 and m["offload/gb_moved"] > 0
    assert last["start_step"] == 3 and len(last["history"]) == 1
    m = last["history"][0]
    assert 1.0 <= m["token_mult_prob_error"] < 1.0 + 1e-4 and m["grad_norm"] > 0.0, m
    assert not any(k.startswith("weight_sync/") for k in m), m
    assert last["heldout"]["prompts"] == 4 and last["heldout"]["length_before"] == h["length_before"]


def test_ppo_on_a_task_in_multi_turn_episodes(first_runs):
    """PPO on data.task's problems (reward.functions without reward_model: no reward model loaded, the
    critic from model.critic_path) in 3-turn episodes of the scripted environment: the trainer's
    logprobs equal vLLM's on every generated token of every turn (fp32), the critic and GAE run on the
    model's tokens only (the environment's are masked), held-out accuracy is the evaluation; and
    algorithm.target_kl stops a step's epochs early."""
    s = first_runs["multi_turn"].summary()
    for m in s["history"]:
        assert 1.0 <= m["token_mult_prob_error"] < 1.0 + 1e-4, m
        assert m["episode/turns"] > 2.0 and m["episode/generated_tokens"] < m["response_length"]
        assert m["reward/environment"] == 0.25 * m["episode/turns"] and m["reward/correctness"] == 0.0
        assert m["loss/value"] > 0.0 and math.isfinite(m["explained_variance"])
        # algorithm.target_kl: the first update moves the policy more than 1.5e-9 from the sampling one, so
        # the second mini-batch's forward stops the step's epochs (1 of 4 updates ran)
        assert m["ppo/policy_updates"] == 1.0 and m["approx_kl"] > 1.5e-9, m
    assert "heldout" not in s and 0.0 <= s["heldout_accuracy_after"] <= 1.0 and s["heldout_size"] == 4
