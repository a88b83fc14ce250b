"""The process reward model end to end on a tiny random Llama, 2 processes (DP=2): the ``prm`` job
trains on step-labelled solutions and exports a sequence classifier whose own scores, read by
``tools/rerank.py`` at every step end, give the held-out step accuracy and loss the job reported;
the outcome-supervised variant trains on the last step only; ``tools/make_prm_data.py`` samples
and labels solutions with vLLM."""

from __future__ import annotations

import json
import math
import os
import random
import subprocess
import sys

import pytest

from alignment.data.step_data import (
    STEP_INSTRUCTION,
    StepRecord,
    label_steps,
    load_records,
    step_prompt,
    write_records,
)
from tests.conftest import ROOT, Job, run_jobs, run_torchrun
from tests.dist.tiny_llama import save_tiny_hf_dir
from tests.test_offline_e2e import COMMON, job

#: the offline jobs' settings a PRM reads (its prompt is never cut: data.max_prompt_length is not its)
PRM_COMMON = [o for o in COMMON if not o.startswith("data.max_prompt_length")]

pytestmark = pytest.mark.slow  # launches processes: the full suite only (CONTRIBUTING.md, test tiers)


def synthetic(n: int, seed: int) -> list[StepRecord]:
    """Two-step sums, a third of the steps off by one (labelled by checking them), then the answer."""
    rng, out = random.Random(seed), []
    for _ in range(n):
        a, b, c = rng.randint(1, 9), rng.randint(1, 9), rng.randint(1, 9)
        first = a + b + (rng.random() < 1 / 3)
        total = first + c + (rng.random() < 1 / 3)
        steps = [f"{a} + {b} = {first}", f"{first} + {c} = {total}", f"The answer is {total}."]
        out.append(StepRecord(step_prompt(f"What is {a} + {b} + {c}?"), steps, label_steps(steps),
                              f"{a} + {b} + {c}", str(a + b + c), total == a + b + c))
    return out


def write_data(path, train: int = 8, heldout: int = 8) -> tuple[list, list]:
    path.mkdir(parents=True)
    train_records, heldout_records = synthetic(train, 0), synthetic(heldout, 1)
    write_records(path / "train.jsonl", train_records)
    write_records(path / "heldout.jsonl", heldout_records)
    (path / "meta.json").write_text(json.dumps({"samples": 2, "separator": "\n"}))
    return train_records, heldout_records


def test_prm_trains_and_its_export_scores_the_steps_as_the_job_did(tmp_path):
    from tools.rerank import main as rerank_main
    from tools.rerank import step_probabilities

    data = tmp_path / "data"
    _, heldout = write_data(data)
    common = [f"data.dataset={data}", "data.max_length=160", "data.train_size=8", "data.heldout_size=8",
              "trainer.global_batch_size=8", "trainer.micro_batch_size=2", "trainer.epochs=3", "trainer.lr=1e-4"]
    s, out = job(tmp_path, "prm", *common, common_overrides=PRM_COMMON)
    losses = [h["loss"] for h in s["history"]]
    assert losses[0] > losses[1] > losses[2], losses  # the same 8 solutions each step
    steps = [y for r in heldout for y in r.labels if y is not None]
    assert len(steps) == 16  # every solution's two equations are labelled, the answer line is not
    assert abs(s["heldout_after"]["positive_fraction"] - sum(steps) / 16) < 1e-9
    assert json.loads((out / "hf" / "config.json").read_text())["architectures"] == ["LlamaForSequenceClassification"]
    # transformers on the export, at the same step ends: the job's held-out step accuracy and BCE
    probs = step_probabilities(str(out / "hf"), heldout)
    scored = [(p, y) for r, ps in zip(heldout, probs) for p, y in zip(ps, r.labels) if y is not None]
    accuracy = sum((p > 0.5) == y for p, y in scored) / len(scored)
    bce = -sum(math.log(p) if y else math.log(1 - p) for p, y in scored) / len(scored)
    assert abs(accuracy - s["heldout_after"]["step_accuracy"]) < 1e-9
    assert abs(bce - s["heldout_after"]["loss"]) < 1e-4, (bce, s["heldout_after"]["loss"])
    result = rerank_main(["--data", str(data), "--prm", str(out / "hf"), "--out", str(tmp_path / "rerank.json")])
    assert result["prm_step_accuracy"] == accuracy and result["problems"] == 4 and result["samples"] == 2
    groups = [heldout[i : i + 2] for i in range(0, 8, 2)]
    assert result["random"] == sum((g[0].outcome + g[1].outcome) / 2 for g in groups) / 4
    assert result["pass@2"] == sum(g[0].outcome or g[1].outcome for g in groups) / 4
    assert json.loads((tmp_path / "rerank.json").read_text()) == result

    # in one launch: the outcome reward model on the same data (one label per solution, the final
    # answer's), and GRPO and PPO with the process reward of the export
    orm, grpo, ppo = run_jobs(
        Job("prm", tmp_path / "tiny", tmp_path / "orm",
            [*PRM_COMMON, *common, "algorithm.supervision=outcome", "trainer.epochs=1", "trainer.save_checkpoint=false",
             "trainer.export_hf=false"]),
        *rl_jobs(tmp_path, out / "hf"))
    assert abs(orm["heldout_before"]["positive_fraction"] - sum(r.outcome for r in heldout) / 8) < 1e-9
    check_rl_jobs_with_the_process_reward(grpo, ppo)
    check_dense_scores(tmp_path, out / "hf")


def check_dense_scores(tmp_path, prm_dir) -> None:
    """An RL job's step scores of generated responses (Megatron, DP 2 / TP 2 / PP 2) are the HF
    export's at the same step ends, placed on the tokens that complete the steps."""
    from transformers import AutoTokenizer

    from alignment.data.step_data import response_steps
    from tools.rerank import step_probabilities

    prompt = step_prompt("What is 3 + 4 + 12?")
    responses = ["3 + 4 = 7\n\n 7 + 12 = 19\nThe answer is 19.", "3 + 4 = 8\n8 + 12 = 20", "  ", "19"]
    (tmp_path / "responses.json").write_text(json.dumps({"prompt": prompt, "responses": responses}))
    run_torchrun("process_reward_worker.py", str(prm_dir), str(tmp_path / "responses.json"),
                 str(tmp_path / "dense.json"))
    got = json.loads((tmp_path / "dense.json").read_text())
    assert set(got) == {"dp2", "tp2", "pp2"}
    tok = AutoTokenizer.from_pretrained(prm_dir)
    split = [response_steps(tok, tok.encode(r, add_special_tokens=False) + [tok.eos_token_id]) for r in responses]
    assert [len(steps) for steps, _ in split] == [3, 2, 0, 1]
    expected = step_probabilities(str(prm_dir), [StepRecord(prompt, steps, [None] * len(steps)) for steps, _ in split])
    for case, result in got.items():
        assert result["positions"] == [where for _, where in split], case
        for mine, ref in zip(result["rewards"], expected):
            assert len(mine) == len(ref) and all(abs(a - b) < 1e-5 for a, b in zip(mine, ref)), (case, mine, ref)


def rl_jobs(tmp_path, prm_dir) -> list[Job]:
    """GRPO (grader + PRM, step-by-step prompts, batches re-dealt over DP) and PPO (reward model +
    PRM) with the process reward model in ``prm_dir``."""
    model = save_tiny_hf_dir(tmp_path / "policy")
    rl = ["rollout.prompts_per_step=4", "rollout.group_size=4", "trainer.micro_batch_size=4", "data.heldout_size=4",
          "data.train_size=16", "rollout.max_tokens=16", "rollout.eval_max_tokens=8", "trainer.lr=1e-3",
          "trainer.progress_bar=false", "trainer.export_hf=false", "trainer.save_checkpoint=false", "trainer.steps=2",
          f"reward.process_reward_model={prm_dir}"]
    return [Job("grpo", model, tmp_path / "grpo",
                [*rl, "reward.functions=[{name: correctness}, {name: process_reward, weight: 0.5}]",
                 f'data.instruction="{STEP_INSTRUCTION}"', "trainer.balance_batch=true"]),
            Job("ppo", model, tmp_path / "ppo",  # on the reward model's prompts: evaluated at rollout.max_tokens
                [*[o for o in rl if not o.startswith("rollout.eval_max_tokens")], f"model.reward_model_path={model}", "trainer.micro_batch_size=2", "trainer.steps=1",
                 "reward.functions=[{name: reward_model}, {name: process_reward}]"])]


def check_rl_jobs_with_the_process_reward(grpo: dict, ppo: dict) -> None:
    """The RL jobs of :func:`rl_jobs` train with the dense term: it is logged apart, and the sample
    rewards are the other terms'."""
    history = grpo["history"]
    assert len(history) == 2
    print("GRPO with the process reward:", history)
    for m in history:
        assert abs(m["reward/mean"] - m["reward/correctness"]) < 1e-6, m  # the dense term is not a sample reward
        assert 0.0 < m["reward/process_reward"] < 1.0 and m["process_reward/steps"] >= 1.0, m
        assert m["grad_norm"] > 0.0 and 1.0 <= m["token_mult_prob_error"] < 1.0 + 1e-4, m
    [m] = ppo["history"]
    assert abs(m["reward/mean"] - m["reward/reward_model"]) < 1e-5, m
    assert 0.0 < m["reward/process_reward"] < 1.0 and m["loss/value"] > 0.0, m


# heavy: the data tool; the PRM job itself runs in CI
@pytest.mark.heavy(cheap="tests/test_prm_e2e.py::test_prm_trains_and_its_export_scores_the_steps_as_the_job_did")
def test_make_prm_data_samples_and_labels_with_vllm(tmp_path):
    from alignment.data.tasks import load_problems, score_response

    model = save_tiny_hf_dir(tmp_path / "tiny")
    out = tmp_path / "data"
    cmd = [sys.executable, str(ROOT / "tools" / "make_prm_data.py"), "--model", str(model), "--out", str(out),
           "--train-problems", "3", "--heldout-problems", "2", "--samples", "2", "--max-tokens", "24",
           "--dtype", "float32", "--kv-cache-gib", "0.1", "--temperature", "1.0"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    meta = json.loads((out / "meta.json").read_text())
    kwargs = {"min_terms": 3, "max_terms": 4, "min_digits": 1, "max_digits": 1}
    assert meta["generator_kwargs"] == kwargs and meta["samples"] == 2
    for split, n in (("train", 3), ("heldout", 2)):
        records = load_records(out, split)
        problems = load_problems("arithmetic", split, n, 0, generator="chain_sum", generator_kwargs=kwargs)
        assert [r.question for r in records] == [p.question for p in problems for _ in range(2)]
        for r, p in zip(records, [p for p in problems for _ in range(2)]):
            assert r.prompt == step_prompt(p.question) and r.answer == p.answer
            assert r.labels == label_steps(r.completions)
            assert r.outcome == (score_response(p, "\n".join(r.completions)) == 1.0)
        stats = meta["splits"][split]
        assert stats["solutions"] == 2 * n and stats["problems"] == n
        assert stats["steps"] == sum(len(r.completions) for r in records)
    train_q = {r.question for r in load_records(out, "train")}
    assert not train_q & {r.question for r in load_records(out, "heldout")}
