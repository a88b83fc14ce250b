"""The worked example (examples/own_task) end to end on a tiny random Llama, through the same job
entry point as every run: chat prompts with a system prompt from a JSONL file made by the example's
script, a held-out file, and reward functions of a user's by import path (TRL's signature)."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from tests.conftest import ROOT, run_torchrun
from tests.dist.tiny_llama import save_tiny_hf_dir

pytestmark = pytest.mark.slow  # launches processes: the full suite only (CONTRIBUTING.md, test tiers)


def test_grpo_on_your_own_files_and_reward_functions(tmp_path):
    data = tmp_path / "gcd"
    subprocess.run([sys.executable, str(ROOT / "examples/own_task/make_data.py"), "--out", str(data), "--chat",
                    "--train-size", "40", "--heldout-size", "8"], check=True, cwd=ROOT)
    model_dir = save_tiny_hf_dir(tmp_path / "tiny")
    out, result = tmp_path / "run", tmp_path / "result.json"
    # even_length first: the held-out grader, and a reward a random model can learn from
    functions = ("[{name: even, function: 'tests.reward_fns:even_length'}, "
                 "{name: 'examples.own_task.rewards:concise', weight: 0.5}]")
    log = run_torchrun("e2e_worker.py", str(model_dir), str(out), "task", "trainer.steps=0", "trainer.epochs=1",
                       f"data.train_files={data / 'train.jsonl'}", f"data.heldout_files=[{data / 'heldout.jsonl'}]",
                       "data.prompt_key=prompt", f"reward.functions={functions}", "rollout.prompts_per_step=16",
                       "rollout.group_size=2", "trainer.micro_batch_size=4", "rollout.max_tokens=8",
                       "rollout.eval_max_tokens=8", "trainer.lr=1e-3", "trainer.progress_bar=false",
                       "trainer.save_checkpoint=false", "trainer.export_hf=false", str(result), timeout=900)
    s = json.loads(result.read_text())
    rows = [json.dumps(json.loads(line)["prompt"]) for name in ("train", "heldout")
            for line in (data / f"{name}.jsonl").read_text().splitlines()]
    held = set(rows[-8:])
    train = len({r for r in rows[:-8] if r not in held})  # distinct training prompts (gcd questions repeat)
    assert f"data: {len(rows)} records from" in log and f"dropped {len(rows) - 8 - train} duplicate and 0 overlong " \
        f"prompts; {train} training prompts, 8 held out" in log, log[-3000:]
    assert s["steps"] == 2 and len(s["history"]) == 2  # steps=0: one epoch of 38-40 prompts, 16 a step
    assert s["heldout_size"] == 8 and 0.0 <= s["heldout_accuracy_after"] <= 1.0
    for m in s["history"]:
        assert 0.0 <= m["reward/even"] <= 1.0 and 0.0 <= m["reward/examples.own_task.rewards:concise"] <= 1.0
        # the job's reward is the weighted sum of the two functions
        assert abs(m["reward/mean"] - (m["reward/even"] + 0.5 * m["reward/examples.own_task.rewards:concise"])) < 1e-5
    assert [m["data/epoch"] for m in s["history"]] == [16 / train, 32 / train]


def test_a_reward_server_that_fails_stops_the_run_with_a_checkpoint(tmp_path):
    """reward.functions: http (on_error: stop): the server answers the start-up probes, the held-out
    grading and step 1, then only 500s: step 2 is not trained, step_1 is saved, the error names the URL."""
    from tests.reward_server import RewardServer

    rows = [{"prompt": f"Count to {i}.", "answer": str(i)} for i in range(24)]
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    model_dir = save_tiny_hf_dir(tmp_path / "tiny")
    out = tmp_path / "run"
    with RewardServer(["ok"] * 6 + ["500"]) as server:  # 2 probes, 2 held-out batches, 2 of step 1 (one per rank)
        log = run_torchrun("e2e_worker.py", str(model_dir), str(out), "task", "trainer.steps=3",
                           f"data.train_files={tmp_path / 'p.jsonl'}", "data.heldout_fraction=0.3",
                           f"reward.functions=[{{name: judge, function: http, url: '{server.url}', max_retries: 1}}]",
                           "rollout.prompts_per_step=4", "rollout.group_size=2", "trainer.micro_batch_size=2",
                           "rollout.max_tokens=8", "rollout.eval_max_tokens=8", "trainer.progress_bar=false",
                           str(tmp_path / "result.json"), expect_failure=True, timeout=900)
    assert f"reward.functions[judge]: reward server {server.url} failed after 2 tries: HTTP 500" in log, log[-3000:]
    assert f"(step 2 not trained; {out / 'checkpoints' / 'step_1'} saved;" in log
    assert (out / "checkpoints" / "step_1" / "metadata.json").exists() and len(server.requests) == 10  # step 2: two tries on each rank
    # the checkpoint names the prompts its steps were taken from (a resume on other files is refused)
    position = json.loads((out / "checkpoints" / "step_1" / "prompts.json").read_text())
    assert position["train_prompts"] == int(re.search(r"; (\d+) training prompts", log).group(1))
    assert len(position["sha256"]) == 64 and position["prompts_per_step"] == 4


# heavy: CI runs GRPO on your own files here and the judge model in tests/test_judge.py
@pytest.mark.heavy(cheap="tests/test_judge.py::test_a_judge_model_run_in_the_job_replies_as_transformers_generates")
def test_online_dpo_on_a_file_with_a_pairwise_judge_and_a_judge_model_in_the_job(tmp_path):
    """algorithm=online_dpo on a prompt file, judged by two judges: a pairwise one behind an OpenAI-compatible
    endpoint (the shorter answer wins, both orders asked), which makes the pairs, and a pointwise judge run by
    vLLM inside each rank (the tiny model itself, weight 0), which grades the held-out answers. With two
    samples per prompt the pairwise scores of a group are (1, 0), or (0.5, 0.5) for a tie: the mean is
    exactly 0.5, the chosen score 1 and the rejected 0, and a step's pairs are its prompts without a tie."""
    from tests.reward_server import ScriptedJudge, shorter_wins

    rows = [{"prompt": f"Write the number {i} in words.", "answer": str(i)} for i in range(40)]
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    model_dir = save_tiny_hf_dir(tmp_path / "tiny")
    functions = (f"[{{name: pair, function: judge, mode: pairwise}}, "
                 f"{{name: local, function: judge, model: '{model_dir}', weight: 0.0, kwargs: {{max_model_len: 512, "
                 "kv_cache_gib: 0.1, max_tokens: 8}}]")
    with ScriptedJudge(shorter_wins) as judge:
        functions = functions.replace("mode: pairwise}", f"mode: pairwise, url: '{judge.url}'}}")
        run_torchrun("e2e_worker.py", str(model_dir), str(tmp_path / "run"), "task", "algorithm=online_dpo",
                     "trainer.steps=2", f"data.train_files={tmp_path / 'p.jsonl'}", "data.heldout_fraction=0.2",
                     f"reward.functions={functions}", "rollout.prompts_per_step=4", "rollout.group_size=2",
                     "trainer.micro_batch_size=1", "rollout.max_tokens=12", "rollout.eval_max_tokens=8",
                     "trainer.lr=1e-3", "trainer.progress_bar=false", "trainer.save_checkpoint=false",
                     "trainer.export_hf=false", str(tmp_path / "result.json"), timeout=900)
        requests = [r["messages"][0]["content"] for r in judge.requests]
    s = json.loads((tmp_path / "result.json").read_text())
    assert len(requests) == 2 * 4 * 2  # steps x prompts x both orders; the held-out answers went to the local judge
    untied = sum(shorter_wins(r) != "[[C]]" for r in requests) // 2
    assert sum(m["online_dpo/pairs"] for m in s["history"]) == untied > 0
    for m in s["history"]:
        assert m["reward/pair"] == 0.5 and m["reward/pair/scored"] == 1.0
        assert m["reward/chosen"] == 1.0 and m["reward/rejected"] == 0.0 and m["grad_norm"] > 0.0
        assert 0.0 <= m["reward/local/scored"] <= 1.0
    assert s["heldout_size"] > 0 and 0.0 <= s["heldout_accuracy_after"] <= 1.0
