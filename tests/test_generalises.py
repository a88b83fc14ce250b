"""Learning that generalises (issue 70): GRPO on training prompts raises the accuracy on held-out
prompts it never saw, by a margin set from measured runs.

The task: reply in at most 2 tokens (``tests.reward_fns:short_reply``, 0/1, the job's held-out
grader), on the EOS-prone tiny model (tests/dist/tiny_llama.py's ``save_eos_prone_hf_dir``: its
replies end after a varying number of tokens, and one direction of the weights makes them shorter).
Held-out accuracy is the sampled pass@1 (``rollout.eval_pass_k=8`` samples per prompt at the rollout's
temperature 1.0, on 16 prompts none of the 48 training prompts equals), before and after 12 steps of
4 prompts x 4 samples (fp32, 2 processes, lr 1e-5, ~28 s). Greedy accuracy says nothing here: that
model's most likely first token is already its end of text (greedy accuracy 1.0 before and after).

Measured over seeds 1-5 (2026-12-02, 2-core Intel Xeon with AMX): pass@1 before 0.102, 0.055, 0.102,
0.117, 0.102; after 1.000, 0.992, 0.969, 0.992, 0.820 (gains 0.72-0.94; after 8 steps seed 5 was at 0.711,
so the run takes 12). The margin asserted, 0.5, is 0.22 below the smallest gain and four times the
largest accuracy before training.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import run_torchrun
from tests.dist.tiny_llama import save_eos_prone_hf_dir

pytestmark = pytest.mark.slow  # launches processes: the full suite only (CONTRIBUTING.md, test tiers)

MARGIN = 0.5
WORDS = ["red", "blue", "green", "cat", "dog", "sun", "moon", "tree", "river", "stone", "bird", "fish"]


def prompts(n: int, offset: int) -> list[dict]:
    """``n`` distinct prompts numbered from ``offset`` (the held-out ones from 1000: none is a training prompt)."""
    return [{"prompt": f"Say something short about the {WORDS[i % 12]} number {offset + i}."} for i in range(n)]


def run_job(work: Path, seed: int) -> dict:
    """The job on its prompt files in ``work``; returns its summary."""
    work.mkdir(parents=True, exist_ok=True)
    for name, rows in (("train", prompts(48, 0)), ("heldout", prompts(16, 1000))):
        (work / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    model_dir = save_eos_prone_hf_dir(work / "eos_prone")
    result = work / "result.json"
    run_torchrun("e2e_worker.py", str(model_dir), str(work / "run"), "task", f"seed={seed}",
                 f"data.train_files={work / 'train.jsonl'}", f"data.heldout_files=[{work / 'heldout.jsonl'}]",
                 "reward.functions=[{name: short, function: 'tests.reward_fns:short_reply'}]", "trainer.steps=12",
                 "rollout.prompts_per_step=4", "rollout.group_size=4", "trainer.micro_batch_size=4",
                 "rollout.max_tokens=16", "rollout.eval_max_tokens=16", "rollout.eval_pass_k=8", "trainer.lr=1e-5",
                 "trainer.progress_bar=false", "trainer.save_checkpoint=false", "trainer.export_hf=false",
                 str(result))
    return json.loads(result.read_text())


def test_grpo_raises_the_accuracy_on_held_out_prompts(tmp_path):
    s = run_job(tmp_path, seed=1)
    assert s["heldout_size"] == 16 and s["steps"] == 12, s
    assert s["pass@1_before"] < 0.2, s  # the untrained model rarely stops within 2 tokens
    assert s["pass@1_after"] >= s["pass@1_before"] + MARGIN, s
