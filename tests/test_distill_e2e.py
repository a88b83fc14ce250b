"""On-policy distillation end to end (``--config-name distill``): a tiny student samples with vLLM, a tiny
teacher of another family scores its tokens, and the student moves towards the teacher. Three jobs in one
launch (2 processes, fp32):

- ``reverse_kl`` at DP=2: the student ends its answers early and often (tests/dist/tiny_llama.py's
  ``save_eos_prone_hf_dir``), the teacher (a random Qwen3) almost never: the teacher gives the student's
  end-of-text tokens a log-probability near -11, so their advantages are strongly negative, and the
  answers grow longer while the sampled reverse KL falls;
- ``forward_kl`` at PP=2 with the task's reward mixed in (``algorithm.task_reward_weight``): the roles
  swapped (a random Llama student, the early-ending teacher), the divergence of the whole distributions
  falls;
- ``jsd`` on a dataset's answers (``algorithm.distill_samples=dataset``, off-policy KD): the student trains on
  exactly the file's answers, and the divergence falls;
- and (heavy) ``forward_kl`` on the teacher's answers (``algorithm.distill_samples=teacher``, off-policy KD)
  at DP=2.
"""

from __future__ import annotations

import json

import pytest

from tests.conftest import Job, run_jobs
from tests.dist.tiny_llama import save_eos_prone_hf_dir, save_tiny_hf_dir
from tests.dist.tiny_models import save_tiny_dir

pytestmark = pytest.mark.slow  # launches processes: the full suite only (CONTRIBUTING.md, test tiers)

COMMON = ["trainer.steps=4", "rollout.prompts_per_step=4", "rollout.group_size=4", "trainer.micro_batch_size=4",
          "data.heldout_size=4", "data.train_size=40", "rollout.max_tokens=16", "rollout.eval_max_tokens=8",
          "trainer.progress_bar=false", "trainer.eval_before=false", "trainer.save_checkpoint=false",
          "trainer.export_hf=false"]


ANSWER = "Yes, it is even."  # every record's answer: each step's mean response length is known


def test_the_student_moves_towards_the_teacher(tmp_path):
    from transformers import AutoTokenizer

    early = save_eos_prone_hf_dir(tmp_path / "eos_prone")
    qwen3 = save_tiny_dir(tmp_path / "qwen3", "qwen3", seed=1)
    llama = save_tiny_hf_dir(tmp_path / "llama", seed=2)
    kd = tmp_path / "kd.jsonl"
    kd.write_text("".join(json.dumps({"prompt": f"Is {2 * i} even?", "completion": ANSWER}) + "\n" for i in range(40)))
    # prompt files: data.task's sizes are not read
    one_answer = [o for o in COMMON if not o.startswith(("rollout.group_size", "trainer.micro_batch_size",
                                                         "data.heldout_size", "data.train_size"))]
    reverse, forward, dataset = run_jobs(
        Job("distill", early, tmp_path / "reverse_kl", [*COMMON, f"model.teacher_path={qwen3}", "trainer.lr=1e-4"]),
        Job("distill", llama, tmp_path / "forward_kl",
            [*COMMON, f"model.teacher_path={early}", "algorithm.distill_loss=forward_kl", "trainer.lr=1e-3",
             "algorithm.task_reward_weight=0.5", "parallel.pipeline_model_parallel_size=2"], reward="even_length"),
        Job("distill", llama, tmp_path / "dataset",
            [*one_answer, f"model.teacher_path={early}", "algorithm.distill_loss=jsd", "trainer.lr=1e-3",
             "algorithm.distill_samples=dataset", f"data.train_files={kd}", "data.response_key=completion",
             "data.heldout_fraction=0.2", "rollout.group_size=1", "trainer.micro_batch_size=2",
             "reward.functions=[{name: even, function: 'tests.reward_fns:even_length'}]"]))
    for s in (reverse, forward):  # on-policy: the student's own samples
        h = s["history"]
        assert len(h) == 4
        for m in h:  # the fp32 engine samples with the trainer's weights, step after step
            assert 1.0 <= m["token_mult_prob_error"] < 1.0 + 1e-4, m
    h = reverse["history"]
    kl, length = [m["distill/reverse_kl"] for m in h], [m["response_length"] for m in h]
    # measured: KL 2.75 -> 1.52, 1.41, 1.57; answers of 6 tokens on average, then all 16 (max_tokens)
    assert kl[0] > 2.0 and max(kl[1:]) < 0.7 * kl[0], kl
    assert length[0] < 10 and length[-1] == 16, length
    assert all(m["distill/divergence"] == 0.0 for m in h)  # reverse_kl reads the sampled tokens only
    h = forward["history"]
    div = [m["distill/divergence"] for m in h]
    assert div[0] > 2.0 and div[-1] < 0.85 * div[0], div
    # the task's reward (even lengths) is computed and mixed in: it varies within the batch
    assert any(m["reward/std"] > 0 for m in h)
    # the file's answers, token for token: the text and the end of the turn, <|im_end|>
    answer_tokens = len(AutoTokenizer.from_pretrained(llama).encode(ANSWER, add_special_tokens=False)) + 1
    h = dataset["history"]
    assert len(h) == 4 and all(m["response_length"] == answer_tokens for m in h), (answer_tokens, h)
    # token_mult_prob_error: against the teacher's logprobs of the answers (no engine sampled them)
    assert all(1.5 < m["token_mult_prob_error"] < 1e6 for m in h), h
    div = [m["distill/divergence"] for m in h]  # GKD's JSD (beta 0.5, at most ln 2): measured 0.362 -> 0.317
    assert div[0] > 0.25 and div[-1] < 0.9 * div[0] and div[-1] == min(div), div


@pytest.mark.heavy(cheap="tests/test_distill_e2e.py::test_the_student_moves_towards_the_teacher")
def test_the_student_learns_from_the_teachers_own_answers(tmp_path):
    """Off-policy KD (``algorithm.distill_samples=teacher``): the early-ending teacher answers with Megatron's
    engine on its own shards (DP=2) and the student learns KL(teacher || student) on those answers: they are the
    teacher's (short, and the student's own logprobs of them far from the sampler's), and the divergence falls."""
    early = save_eos_prone_hf_dir(tmp_path / "eos_prone")
    llama = save_tiny_hf_dir(tmp_path / "llama", seed=2)
    [off_policy] = run_jobs(Job("distill", llama, tmp_path / "teacher_samples",
                                [*COMMON, f"model.teacher_path={early}", "algorithm.distill_loss=forward_kl",
                                 "trainer.lr=1e-3", "algorithm.distill_samples=teacher"]))
    h = off_policy["history"]
    assert all(m["response_length"] < 10 and m["token_mult_prob_error"] > 1.05 for m in h), h
    div = [m["distill/divergence"] for m in h]
    assert div[0] > 2.0 and div[-1] < 0.85 * div[0], div
