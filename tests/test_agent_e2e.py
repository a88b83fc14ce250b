"""GRPO on an agent program's episodes (``rollout.agent=tests.agent_examples:three_turns``, written against the
``openai`` client only) end to end, three jobs in one launch (2 processes, fp32):

- vLLM behind the job's rollout server, the two ranks holding one model replica (context parallelism 2,
  packed), so the first rank serves and the second generates in lockstep with it;
- Megatron's inference engine behind it (``rollout.backend=megatron``, DP = 2: a server per rank);
- PPO with a critic and LoRA adapters (vLLM, DP = 2).

In both the trainer's logprobs equal the engine's on every model token of the 3-turn episodes (fp32
``token_mult_prob_error`` 1: an inserted user turn counted as the model's would break it), the agent's
reward is the ``environment`` term, and the task whose agent crashes is dropped and counted."""

from __future__ import annotations

import json

import pytest

from tests.conftest import Job, run_jobs
from tests.dist.tiny_llama import save_tiny_hf_dir

pytestmark = pytest.mark.slow  # launches processes: the full suite only (CONTRIBUTING.md, test tiers)


def test_grpo_trains_on_an_openai_client_agents_episodes(tmp_path):
    rows = [{"prompt": f"Count to {n}.", "answer": str(n)} for n in (3, 4, 7, 5, 6, 8, 9, 2)]  # step 2 holds the 7
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "heldout.jsonl").write_text(json.dumps({"prompt": "Count to 2.", "answer": "2"}) + "\n")
    model_dir = save_tiny_hf_dir(tmp_path / "tiny")
    common = ["trainer.steps=2", f"data.train_files={tmp_path / 'train.jsonl'}",
              f"data.heldout_files=[{tmp_path / 'heldout.jsonl'}]", "data.shuffle=false",
              "rollout.agent=tests.agent_examples:three_turns", "rollout.agent_timeout_s=120", "rollout.group_size=4",
              "trainer.micro_batch_size=2", "rollout.agent_max_tokens=64",
              "reward.functions=[{name: environment}, {name: exact_match, weight: 0.0}]", "trainer.lr=1e-3", "trainer.progress_bar=false",
              "trainer.eval_before=false", "trainer.save_checkpoint=false", "trainer.export_hf=false"]
    cp, megatron, ppo = run_jobs(
        Job("grpo", model_dir, tmp_path / "vllm_cp2", [*common, "rollout.prompts_per_step=2",
                                                       "parallel.context_parallel_size=2",
                                                       "trainer.sequence_packing=true"]),
        Job("grpo", model_dir, tmp_path / "megatron", [*common, "rollout.prompts_per_step=4",
                                                       "rollout.backend=megatron"]),
        Job("ppo", model_dir, tmp_path / "ppo_lora", [*common, "rollout.prompts_per_step=4",
                                                      f"model.critic_path={model_dir}", "model.reward_model_path=''",
                                                      "model.lora.rank=4", "trainer.critic_lr=1e-3"]))
    for s in (cp, megatron, ppo):
        history = s["history"]
        assert len(history) == 2
        for m in history:  # every model token of every turn, as the engine sampled it
            assert 1.0 <= m["token_mult_prob_error"] < 1.0 + 1e-4, m
            assert m["episode/env_tokens"] > 0, m
            assert m["episode/generated_tokens"] < m["response_length"]  # the follow-up user turns are not the model's
            assert 0.0 <= m["reward/environment"] <= 1.0
        # the held-out task was played by the agent and graded (its accuracy on one problem says nothing of
        # learning: tests/test_generalises.py asserts that)
        assert s["heldout_size"] == 1 and "heldout_accuracy_after" in s
    first, second = cp["history"]
    assert (first["episode/failed"], first["episode/dropped_groups"]) == (0.0, 0.0) and first["episode/turns"] == 3.0
    # the task whose answer is 7: its four episodes crash, its group is dropped, the other trains
    assert (second["episode/failed"], second["episode/timeout"], second["episode/dropped_groups"]) == (4.0, 0.0, 1.0)
    assert second["episode/turns"] == 1.5 and second["grad_norm"] > 0.0  # a dropped episode counts no turn
    # DP=2, four tasks a step (one per rank pair): the 7 is in step 1 there
    first, second = megatron["history"]
    assert (first["episode/failed"], first["episode/dropped_groups"]) == (4.0, 1.0)
    assert (second["episode/failed"], second["episode/dropped_groups"]) == (0.0, 0.0) and second["episode/turns"] == 3.0
    # PPO with LoRA adapters (DP=2): the engine samples with the merged adapters after the first update
    # (the prob error above), the policy moved off its reference (the adapters off), the counts as GRPO's
    first, second = ppo["history"]
    assert (first["episode/failed"], first["episode/timeout"], first["episode/dropped_groups"]) == (4.0, 0.0, 1.0)
    assert (second["episode/failed"], second["episode/dropped_groups"]) == (0.0, 0.0) and second["episode/turns"] == 3.0
    assert first["kl"] == 0.0 and second["kl"] != 0.0 and second["loss/value"] > 0.0
