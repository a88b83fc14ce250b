"""The sbatch scripts (slurm/*.sbatch -> slurm/launch.sh -> launchers/train.py) on a real
2-node Slurm cluster on this host (:mod:`tests.slurm_cluster`): a tiny SFT job on 2 nodes x 1
task, a job preempted by USR1 that checkpoints, requeues itself and resumes to the same result
as the uninterrupted run, and config errors caught before any training process starts.
Skipped when Slurm is not installed."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.slow  # launches processes: the full suite only (CONTRIBUTING.md, test tiers)

STEPS = 32  # 32 examples / global batch 4 = 8 steps per epoch, 4 epochs


def job_args(model_dir: Path, out: Path, *extra: str) -> list[str]:
    """Hydra overrides of a tiny SFT job (2 data-parallel ranks, 0.1-0.3 s per step here)."""
    return [f"model.path={model_dir}", f"output_dir={out}", "data.max_length=64", "data.max_prompt_length=32",
            "data.train_size=32", "data.heldout_size=8", "trainer.global_batch_size=4", "trainer.micro_batch_size=2",
            "trainer.lr=1e-3", "trainer.epochs=4", "trainer.progress_bar=false", *extra]


def job_env(**extra: str) -> dict[str, str]:
    """The submitter's environment: this venv's python, one CPU thread per process whichever the
    launcher (the two "nodes" share this host's 2 cores; torchrun's workers see one process per
    node, so the thread count is set, not derived)."""
    bin_dir = str(Path(sys.executable).parent)
    return {"PATH": f"{bin_dir}:{os.environ['PATH']}", "MEGALIGN_PYTHON": sys.executable, "OMP_NUM_THREADS": "1",
            "LOCAL_WORLD_SIZE": "2", "MEGALIGN_CPU_THREADS": "1", **extra}


def wait_for_line(path: Path, pattern: str, timeout: float) -> float:
    """Poll ``path`` until a line matches ``pattern``; returns the time it appeared."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if path.exists() and re.search(pattern, path.read_text(errors="replace")):
            return time.time()
        time.sleep(0.2)
    raise TimeoutError(f"{pattern!r} not in {path} after {timeout} s:\n"
                       f"{path.read_text(errors='replace')[-4000:] if path.exists() else '(no file)'}")


@pytest.fixture(scope="module")
def reference(slurm_cluster, tiny_model_dir, tmp_path_factory):
    """An uninterrupted 2-node job submitted as a user would (default log path), run once."""
    out = tmp_path_factory.mktemp("sft_ref") / "out"
    t0 = time.time()
    job = slurm_cluster.sbatch("--nodes=2", "--ntasks-per-node=1", "--gpus-per-node=1", "slurm/sft.sbatch",
                               *job_args(tiny_model_dir, out), cwd=ROOT, env=job_env())
    info = slurm_cluster.wait(job, timeout=240)
    log = ROOT / "slurm" / "logs" / f"megalign-sft-{job}.out"
    text = log.read_text(errors="replace") if log.exists() else "(no log)"
    log.unlink(missing_ok=True)
    return {"job": job, "info": info, "out": out, "log": text, "seconds": time.time() - t0}


def test_two_node_sft_job_through_sbatch(reference):
    info, out, log = reference["info"], reference["out"], reference["log"]
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", (info, log[-4000:])
    assert info["NumNodes"] == "2" and info["NodeList"] == "n[1-2]" and info["Restarts"] == "0"
    s = json.loads((out / "summary.json").read_text())
    assert s["world_size"] == 2 and s["steps"] == STEPS and s["start_step"] == 0 and len(s["history"]) == STEPS
    # one data-parallel gradient step per step on the same 32 examples: the loss goes down
    assert s["heldout_before"]["loss"] > 10.0 and s["heldout_after"]["loss"] < s["heldout_before"]["loss"] - 1.0
    assert (out / "checkpoints" / f"step_{STEPS}" / "metadata.json").exists()
    assert (out / "hf" / "model.safetensors").exists()
    # the log (slurm/logs/%x-%j.out): launcher header, the config check, training output
    assert f"job {reference['job']} (megalign-sft) restart 0: 2 node(s) n[1-2], 1 process(es) per node, " \
           "world size 2, srun, rendezvous 127.0.0.1:" in log
    assert "preflight ok: sft (sft), world size 2" in log and "held-out after:" in log and "training finished" in log
    # the Hydra overrides reached both ranks' config
    cfg = (out / "config.yaml").read_text()
    assert "lr: 0.001" in cfg and "train_size: 32" in cfg and "global_batch_size: 4" in cfg and str(out) in cfg


# heavy: CI time: preemption's stop and resume also run in tests/test_preemption.py and test_resume.py
@pytest.mark.heavy(cheap="tests/test_preemption.py::test_all_ranks_stop_at_the_same_step_and_exit_75")
def test_preempted_job_requeues_and_resumes_where_it_stopped(slurm_cluster, tiny_model_dir, reference, tmp_path):
    """USR1 to the batch shell (what #SBATCH --signal=B:USR1@N delivers before the time limit):
    the trap tells the training processes to stop, they checkpoint the step they are at and
    exit, the trap requeues the job, and the second run resumes there and ends exactly where
    the uninterrupted run ended. One torchrun per node here (MEGALIGN_LAUNCHER=torchrun)."""
    out, log = tmp_path / "out", tmp_path / "job.out"
    job = slurm_cluster.sbatch("--nodes=2", "--ntasks-per-node=1", "--gpus-per-node=1", f"--output={log}",
                               "slurm/sft.sbatch", *job_args(tiny_model_dir, out), cwd=ROOT,
                               env=job_env(MEGALIGN_LAUNCHER="torchrun", MEGALIGN_STOP_FILE=str(tmp_path / "stop")))
    wait_for_line(log, r"held-out before", timeout=120)  # the training loop starts right after
    time.sleep(0.5)
    signalled = time.time()
    subprocess.run(["scancel", "--signal=USR1", "--batch", str(job)], env=slurm_cluster.env, check=True)
    resumed_at = wait_for_line(log, r"restart 1:", timeout=120)
    info = slurm_cluster.wait(job, timeout=180)
    text = log.read_text(errors="replace")
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0" and info["Restarts"] == "1", \
        (info, text[-4000:])
    stopped = re.search(r"preempted \(SIGUSR1\): checkpoint at step (\d+) saved", text)
    resumed = re.search(r"resumed from (\S+) \(step (\d+)\)", text)
    assert stopped and resumed, text[-4000:]
    n = int(stopped.group(1))
    assert 0 < n < STEPS and int(resumed.group(2)) == n and resumed.group(1) == str(out / "checkpoints" / f"step_{n}")
    assert "got USR1: asking the training processes to checkpoint and stop" in text
    assert f"requeueing job {job}" in text
    s = json.loads((out / "summary.json").read_text())
    ref = json.loads((reference["out"] / "summary.json").read_text())
    assert s["start_step"] == n and s["steps"] == STEPS and len(s["history"]) == STEPS - n
    # same data order and optimizer state after the resume: the same losses as without preemption
    for a, b in zip(s["history"], ref["history"][n:]):
        assert abs(a["loss"] - b["loss"]) < 1e-6, (a["loss"], b["loss"])
    assert abs(s["heldout_after"]["loss"] - ref["heldout_after"]["loss"]) < 1e-6
    print(f"stopped at step {n}; signal -> requeued run started: {resumed_at - signalled:.1f} s")


def test_config_errors_stop_the_job_before_training(slurm_cluster, tiny_model_dir, tmp_path):
    # TP=3 cannot split the tiny model's 4 heads: the preflight names the field, no rank starts
    log = tmp_path / "tp.out"
    job = slurm_cluster.sbatch("--nodes=2", "--ntasks-per-node=1", "--gpus-per-node=1", f"--output={log}",
                               "slurm/dpo.sbatch",
                               *job_args(tiny_model_dir, tmp_path / "out", "parallel.tensor_model_parallel_size=3"),
                               cwd=ROOT, env=job_env())
    info = slurm_cluster.wait(job, timeout=120)
    text = log.read_text()
    assert info["JobState"] == "FAILED" and info["ExitCode"] == "2:0", (info, text)
    assert "parallel.tensor_model_parallel_size=3 must divide the model's 4 attention heads" in text
    assert "nothing was started" in text and "held-out" not in text and not (tmp_path / "out").exists()
    # one process per GPU: 2 tasks on a node with 1 GPU is refused with the #SBATCH line to fix
    log = tmp_path / "gpus.out"
    job = slurm_cluster.sbatch("--nodes=1", "--ntasks-per-node=2", "--gpus-per-node=1", f"--output={log}",
                               "slurm/grpo.sbatch", cwd=ROOT, env=job_env())
    info = slurm_cluster.wait(job, timeout=60)
    text = log.read_text()
    assert info["JobState"] == "FAILED" and info["ExitCode"] == "2:0", (info, text)
    assert "2 tasks per node but 1 GPUs per node" in text and "#SBATCH --ntasks-per-node=1" in text
