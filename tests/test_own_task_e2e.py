"""The worked example (examples/own_task) end to end on a tiny random Llama, through the same job
entry point as every run: chat prompts with a system prompt from a JSONL file made by the example's
script, a held-out file, and reward functions of a user's by import path (TRL's signature)."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.conftest import ROOT, run_torchrun
from tests.dist.tiny_llama import save_tiny_hf_dir


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
