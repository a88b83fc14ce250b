"""launchers/nemo_launch.py: the sbatch script nemo-run's SlurmExecutor generates (dry run), a
tiny SFT job run by nemo-run's LocalExecutor (torchrun, 2 processes), and the same job submitted
by the SlurmExecutor to the local 2-node Slurm cluster, which must give the same result.
Skipped without nemo-run (``pip install -e ".[launch]"``; .ci/run installs it)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.slow  # launches processes: the full suite only (CONTRIBUTING.md, test tiers)

pytest.importorskip("nemo_run", reason="nemo-run is not installed (pip install -e '.[launch]', see .ci/run)")


def tiny_sft(model_dir: Path, out: Path) -> list[str]:
    """Overrides of a 4-step SFT job on a tiny random Llama (2 data-parallel ranks)."""
    return [f"model.path={model_dir}", f"output_dir={out}", "data.max_length=64", "data.max_prompt_length=32",
            "data.train_size=16", "data.heldout_size=8", "trainer.global_batch_size=4", "trainer.micro_batch_size=2",
            "trainer.lr=1e-3", "trainer.progress_bar=false"]


def cli(tmp_path: Path, *args: str, env: dict | None = None, timeout: int = 300) -> str:
    """Run ``python launchers/nemo_launch.py *args`` with this venv first on PATH (nemo-run's
    local processes run ``python`` from PATH), no stdin (nemo-run's shell calls read it) and
    ``$NEMORUN_HOME`` in ``tmp_path`` (not named ``nemo_run``: nemo-run 0.11.1 replaces every
    "/nemo_run" in a generated sbatch script); returns the output, failing on a non-zero exit."""
    full = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "OMP_NUM_THREADS": "1",
            "NEMORUN_HOME": str(tmp_path / "nemorun_home"), **(env or {})}
    p = subprocess.run([sys.executable, str(ROOT / "launchers" / "nemo_launch.py"), *args], cwd=tmp_path, env=full,
                       stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-6000:]
    return out


def sbatch_scripts(tmp_path: Path, name: str) -> list[str]:
    """The ``<task>_sbatch.sh`` files nemo-run wrote for experiment ``name`` under ``tmp_path``."""
    return [p.read_text() for p in (tmp_path / "nemorun_home" / "experiments" / name).glob("*/*_sbatch.sh")]


def test_slurm_executor_dryrun_writes_the_expected_sbatch_script(tmp_path):
    cli(tmp_path, "--config-name", "grpo", "--executor", "slurm", "--account", "acct", "--partition", "batch",
        "--nodes", "2", "--gpus-per-node", "8", "--time", "01:00:00", "--retries", "2", "--dryrun",
        "trainer.steps=5", "parallel.tensor_model_parallel_size=2")
    [script] = sbatch_scripts(tmp_path, "megalign-grpo")
    for line in ("#SBATCH --account=acct", "#SBATCH --partition=batch", "#SBATCH --nodes=2",
                 "#SBATCH --ntasks-per-node=8", "#SBATCH --gpus-per-node=8", "#SBATCH --time=01:00:00",
                 "#SBATCH --signal=USR1@300", "#SBATCH --job-name=megalign-grpo", "sbatch --requeue --parsable",
                 "#SBATCH --open-mode=append", "export TORCHX_MAX_RETRIES=2",
                 "export MASTER_PORT=${MASTER_PORT:-$((20000 + SLURM_JOB_ID % 20000))}"):
        assert line in script, (line, script)
    assert "sed -n 's/^NodeAddr=//p'" in script  # MASTER_ADDR is the head node's address
    srun = next(ln for ln in script.splitlines() if ln.startswith("srun "))
    # the overrides, and the relative output_dir made absolute (from the repository root)
    assert srun.endswith(f"python {ROOT}/launchers/train.py --config-name grpo trainer.steps=5 "
                         f"parallel.tensor_model_parallel_size=2 output_dir={ROOT}/outputs/grpo_smollm2_arithmetic")
    # without the options the allocation comes from the config's cluster group
    from launchers.preflight import compose

    c = compose("grpo", ["cluster=slurm_h100x8"]).cluster
    cli(tmp_path, "--config-name", "grpo", "--executor", "slurm", "--dryrun", "cluster=slurm_h100x8",
        "cluster.account=acct")
    [script] = [t for t in sbatch_scripts(tmp_path, "megalign-grpo") if "cluster=slurm_h100x8" in t]
    for line in (f"#SBATCH --nodes={c.nodes}", f"#SBATCH --gpus-per-node={c.gpus_per_node}",
                 f"#SBATCH --ntasks-per-node={c.gpus_per_node}", f"#SBATCH --partition={c.partition}",
                 f"#SBATCH --time={c.time}", f"#SBATCH --signal=USR1@{c.preempt_signal_seconds}"):
        assert line in script, (line, script)
    # a layout the world size cannot hold is refused before anything is written or submitted
    from launchers.nemo_launch import absolute_output_dir
    from parallel.layout import LayoutError

    with pytest.raises(LayoutError, match=r"world size 16 is not divisible by parallel.tensor_model_parallel_size x "
                       r"pipeline_model_parallel_size x context_parallel_size = 3 x 1 x 1"):
        absolute_output_dir("sft", [f"model.path={ROOT / 'missing'}", "parallel.tensor_model_parallel_size=3"], 16)


@pytest.fixture(scope="module")
def local_run(tiny_model_dir, tmp_path_factory):
    """The tiny SFT job run by nemo-run's LocalExecutor (torchrun, 2 processes)."""
    tmp = tmp_path_factory.mktemp("nemo_local")
    log = cli(tmp, "--config-name", "sft", "--nproc", "2", *tiny_sft(tiny_model_dir, tmp / "out"))
    return json.loads((tmp / "out" / "summary.json").read_text()), log


def test_local_executor_runs_a_tiny_job(local_run):
    s, log = local_run
    assert s["world_size"] == 2 and s["steps"] == 4 and len(s["history"]) == 4
    assert s["heldout_before"]["loss"] > 10.0 and s["heldout_after"]["loss"] < s["heldout_before"]["loss"]
    assert "held-out after:" in log and re.search(r"nemo-run: \w+ job .*experiment dir .*megalign-sft", log)


@pytest.mark.heavy(cheap="tests/test_nemo_launch.py::test_slurm_executor_dryrun_writes_the_expected_sbatch_script")
def test_slurm_executor_submits_to_the_local_cluster(slurm_cluster, tiny_model_dir, local_run, tmp_path):
    out = tmp_path / "out"
    log = cli(tmp_path, "--config-name", "sft", "--executor", "slurm", "--account", "acct", "--partition", "debug",
              "--nodes", "2", "--gpus-per-node", "1", "--time", "00:10:00", "--detach", *tiny_sft(tiny_model_dir, out),
              env={**slurm_cluster.env, "LOCAL_WORLD_SIZE": "2"})
    job = int(re.search(r"nemo-run: \w+ job (\d+)", log).group(1))
    info = slurm_cluster.wait(job, timeout=240)
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", (info, log[-3000:])
    assert info["JobName"] == "megalign-sft" and info["NumNodes"] == "2" and info["NodeList"] == "n[1-2]"
    s = json.loads((out / "summary.json").read_text())
    assert s["world_size"] == 2 and s["steps"] == 4
    # 2 srun tasks on 2 nodes compute exactly what 2 torchrun processes on one machine did
    ref, _ = local_run
    assert abs(s["heldout_after"]["loss"] - ref["heldout_after"]["loss"]) < 1e-6
    assert [h["loss"] for h in s["history"]] == pytest.approx([h["loss"] for h in ref["history"]], abs=1e-6)
