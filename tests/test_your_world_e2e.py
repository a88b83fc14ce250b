"""A user's world as it is, end to end on a tiny random Llama (2 processes, fp32):

- a parquet written exactly as verl's ``examples/data_preprocess/gsm8k.py`` writes it trains GRPO with the
  user's unchanged verl ``compute_score``, from a job file in the user's own folder (``--config-dir``), the
  reward module imported from the working directory (as ``python -m`` does): the reference answers reaching
  the function are exactly the file's ``reward_model.ground_truth``, and the job file is copied into the run;
- each of TRL's dataset types trains in the job whose TRL trainer takes it (one launch): SFT on
  prompt-completion and plain text, DPO on conversational pairs, the reward model on pairs with an implicit
  prompt, KTO on unpaired labelled completions; each learns (training loss falls over the same examples, the
  held-out loss falls or its margin grows)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap

import pytest

from tests.conftest import ROOT, Job, run_jobs
from tests.dist.tiny_llama import save_tiny_hf_dir
from tests.foreign_data import COMPUTE_SCORE, extract_solution, gsm8k_rows, trl_records, write_gsm8k_parquet

pytestmark = pytest.mark.slow  # launches processes: the full suite only (CONTRIBUTING.md, test tiers)


def test_verls_gsm8k_parquet_trains_grpo_with_the_users_compute_score(tmp_path):
    rows = gsm8k_rows(24)
    parquet = write_gsm8k_parquet(tmp_path / "data" / "gsm8k" / "train.parquet", rows)
    model_dir = save_tiny_hf_dir(tmp_path / "tiny")
    project = tmp_path / "project"  # the user's project: their reward module and their job file
    (project / "configs").mkdir(parents=True)
    (project / "my_reward.py").write_text(COMPUTE_SCORE)
    job = textwrap.dedent(f"""\
        defaults:
          - grpo
          - _self_
        model: {{path: {model_dir}, dtype: float32}}
        data: {{train_files: {parquet}, heldout_fraction: 0.25}}
        reward:
          functions: [{{name: 'my_reward:compute_score'}}]
        rollout: {{max_tokens: 12, prompts_per_step: 4, group_size: 2}}
        trainer: {{steps: 2, micro_batch_size: 4, progress_bar: false, save_checkpoint: false, export_hf: false}}
        output_dir: {tmp_path / 'run'}
        """)
    (project / "configs" / "verl_gsm8k.yaml").write_text(job)
    record = tmp_path / "record.jsonl"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RECORD": str(record), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "tools.cli", "train", "--nproc", "2", "--config-dir", "configs",
                           "--config-name", "verl_gsm8k"], cwd=project, env=env, capture_output=True, text=True,
                          timeout=900)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["steps"] == 2 and len(summary["history"]) == 2
    # every call of the user's function got verl's arguments: the file's own reference answers
    truths = {str(i): extract_solution(r["answer"]) for i, r in enumerate(rows)}
    calls = [json.loads(line) for line in record.read_text().splitlines()]
    assert len(calls) >= 2 * 4 * 2 and {c["data_source"] for c in calls} == {"openai/gsm8k"}
    assert all(c["ground_truth"] == truths[str(c["extra_info"]["index"])] for c in calls), calls[:3]
    assert all(c["extra_info"]["question"] == rows[c["extra_info"]["index"]]["question"] for c in calls)
    # the start-up summary named the reference and the convention; the job file travelled with the run
    assert "reference answer: column reward_model.ground_truth" in log and "verl's compute_score" in log
    assert (tmp_path / "run" / "job.yaml").read_text() == job
    assert "columns the job does not read: ability" in log


def test_each_of_trls_dataset_types_trains_in_its_job(tmp_path):
    model_dir = save_tiny_hf_dir(tmp_path / "tiny")
    job_of = {"sft": ("sft", []), "dpo": ("dpo", ["algorithm.beta=0.5"]), "rm": ("rm", []),
              "kto": ("dpo", ["algorithm.loss_type=kto", "algorithm.beta=0.5"])}
    kinds = sorted(trl_records())  # every type, standard and conversational
    jobs = []
    for kind in kinds:
        job, records = trl_records(16)[kind]
        path = tmp_path / f"{kind}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
        config, extra = job_of[job]
        jobs.append(Job(config, model_dir, tmp_path / kind, [
            "data=file", f"data.dataset={path}", "data.heldout_fraction=0.25", "data.max_length=64",
            "data.max_prompt_length=48", "trainer.global_batch_size=4", "trainer.micro_batch_size=2",
            "trainer.steps=3", "trainer.epochs=3", "trainer.lr=1e-3", "trainer.progress_bar=false",
            "trainer.save_checkpoint=false", "trainer.export_hf=false", *extra]))
    for kind, s in zip(kinds, run_jobs(*jobs)):
        losses = [h["loss"] for h in s["history"]]
        assert len(losses) == 3 and all(math.isfinite(x) for x in losses), (kind, losses)
        before, after = s["heldout_before"], s["heldout_after"]
        if kind.startswith("unpaired_preference"):  # KTO: the desirable completions' implicit reward pulls ahead
            assert after["margin"] > before["margin"] and "kl" in after, (kind, before, after)
        else:
            assert after["loss"] < before["loss"], (kind, before, after)
