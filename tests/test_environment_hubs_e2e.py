"""GRPO on environment hubs' environments end to end: verifiers (``rollout.environment=verifiers``,
``rollout.environment_id=tests.verifiers_envs``) and OpenEnv (``rollout.environment=openenv``), three jobs in one
launch on a tiny random Llama (2 processes, DP = 2, fp32, Megatron's engine behind each rank's rollout server):

- a ``SingleTurnEnv`` whose rubric has two weighted functions and a group-level one, its eval dataset the
  held-out prompts: every reward in the rollout table is the rubric's, computed again here from the recorded
  answer's text (the group-level function over the table's group), and the trainer's logprobs equal the
  engine's on every token (fp32 ``token_mult_prob_error`` 1);
- a ``MultiTurnEnv`` that asks "Are you sure?" after each model turn, three model turns an episode, its reward
  combined with another term (``length``): the inserted user turns are the environment's (loss mask 0), so the
  trainer's logprobs still equal the engine's on every model token.

- OpenEnv's number-guessing game (``tests/openenv_envs.py``) served by uvicorn beside each rank: the reset
  observation the prompt, each reply a guess sent through ``step()``, the game's answers user turns (loss mask 0),
  its step rewards summed.

(A ``ToolEnv``'s tool turn through the server is tested with a scripted model, tests/test_verifiers_env.py: a
random model calls no tool.)"""

from __future__ import annotations

import json

import pytest

from tests.conftest import Job, run_jobs
from tests.dist.tiny_llama import save_tiny_hf_dir

pytestmark = pytest.mark.slow  # launches processes: the full suite only (CONTRIBUTING.md, test tiers)

GROUP = 4


def rubric(answer: str, text: str, texts: list[str]) -> float:
    """tests.verifiers_envs' single-turn rubric with group=True, by hand."""
    return float(answer in text) + 0.5 * float(len(text) % 2 == 0) + 0.25 * float(texts.count(text) == 1)


def test_grpo_trains_on_environment_hubs(tmp_path):
    model_dir = save_tiny_hf_dir(tmp_path / "tiny")
    common = ["trainer.steps=2", f"rollout.group_size={GROUP}", "rollout.prompts_per_step=4", "rollout.backend=megatron",
              "rollout.agent_max_tokens=48", "rollout.agent_max_tokens_per_turn=16", "rollout.agent_timeout_s=120",
              "trainer.micro_batch_size=2", "trainer.lr=1e-3", "trainer.progress_bar=false",
              "trainer.rollout_table_every=1", "trainer.eval_before=false", "trainer.save_checkpoint=false",
              "trainer.export_hf=false"]
    verifiers = ["rollout.environment=verifiers", "rollout.environment_id=tests.verifiers_envs"]
    single, multi, game = run_jobs(
        Job("grpo", model_dir, tmp_path / "single_turn",
            [*common, *verifiers, "rollout.environment_args={num_train: 8, num_eval: 2, group: true}"]),
        Job("grpo", model_dir, tmp_path / "multi_turn",
            [*common, *verifiers, "rollout.environment_args={kind: multi_turn, num_train: 8, num_eval: 2}",
             "rollout.agent_max_tokens=96",  # three turns of 16 and two user turns between them
             "reward.functions=[{name: environment}, {name: length, weight: 0.1}]"]),
        Job("grpo", model_dir, tmp_path / "openenv",
            [*common, "rollout.environment=openenv", "rollout.environment_id=tests.openenv_envs:GuessEnv",
             "rollout.environment_args={app: 'tests.openenv_envs:app', train_size: 8, heldout_size: 2, max_turns: 3}",
             "rollout.max_model_len=160", "rollout.agent_max_tokens=80"]))
    for s in (single, multi, game):
        assert len(s["history"]) == 2 and s["heldout_size"] == 2 and "heldout_accuracy_after" in s
        for m in s["history"]:  # every model token, as the engine sampled it
            assert 1.0 <= m["token_mult_prob_error"] < 1.0 + 1e-4, m
            assert (m["episode/failed"], m["episode/timeout"], m["episode/dropped_groups"]) == (0.0, 0.0, 0.0), m
    questions = {f"What is {a} + {b}?": str(a + b) for a in range(1, 41) for b in range(1, 41)}
    rewards = []
    for step in (1, 2):
        rows = [json.loads(line) for line in
                (tmp_path / "single_turn" / "rollouts" / f"step_{step:06d}.jsonl").read_text().splitlines()]
        assert len(rows) == 2 * GROUP  # rank 0's share: two tasks of four episodes
        for g in range(0, len(rows), GROUP):
            group = rows[g:g + GROUP]
            [question] = {q for q in questions if q in group[0]["prompt"]}
            assert all(question in r["prompt"] for r in group)
            texts = [r["answer"] for r in group]
            for r in group:
                want = rubric(questions[question], r["answer"], texts)
                assert r["reward/environment"] == pytest.approx(want, abs=1e-6), r
                assert r["reward"] == pytest.approx(want, abs=1e-6)  # the environment term alone, weight 1
                rewards.append(want)
    assert len(set(rewards)) > 1  # the rubric's terms varied, so GRPO had advantages to learn from
    assert all(m["grad_norm"] > 0 for m in single["history"])
    for m in multi["history"]:  # three model turns, two inserted user turns, each episode
        assert m["episode/turns"] == 3.0 and m["episode/env_tokens"] > 0, m
        assert m["episode/generated_tokens"] < m["response_length"]  # the user turns are not the model's
        assert 0.0 <= m["reward/environment"] <= 1.5 and m["reward/length"] < 0.0
    for m in game["history"]:  # a guess per turn, the game's answer between two: up to 3 turns, rewards summed
        assert 1.0 <= m["episode/turns"] <= 3.0 and m["episode/env_tokens"] > 0, m
        assert -0.3 <= m["reward/environment"] <= 1.0, m
    rows = [json.loads(line) for line in (tmp_path / "openenv" / "rollouts" / "step_000001.jsonl").read_text().splitlines()]
    for r in rows:  # what the game said between the model's turns is in the episode, a reply per turn
        assert "I am thinking of a digit" in r["prompt"]
        assert r["response"].count("<|im_start|>user\n") == r["turns"] - 1
        said = r["response"].split("<|im_start|>user\n")[1:]
        assert all(x.startswith(("higher", "lower", "Say one digit.")) for x in said), r["response"]
