"""One rank of a 2-rank GRPO job (vLLM engines) fails while the other goes on (tests/dist/rank_death_worker.py),
launched as ``megalign train`` launches (``tools.cli.launch``): SIGKILLed inside its generation, while
the other waits in a collective, and with its checkpoint shards written but not published; and
SIGSTOPped (a hung rank) with ``trainer.collective_timeout_s=10``. Each time the job ends within 60 s
of the failure, no process of it is left (the ranks and anything they started, found by an
environment tag), and ``megalign train``'s report (``launchers.phase_log.failure_report``) names the
rank, its pid and the phase and step it was in (for the hang: the rank that stopped answering and
the one that gave up waiting). After the kill during the checkpoint the same command resumes from
the last complete checkpoint and finishes."""

from __future__ import annotations

import json
import os
import time
import uuid
from pathlib import Path

import psutil
import pytest

from launchers.phase_log import failure_report, read_phases
from tests.dist.tiny_llama import save_tiny_hf_dir

pytestmark = pytest.mark.slow  # launches processes: the full suite only (CONTRIBUTING.md, test tiers)

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "dist" / "rank_death_worker.py"
COMMON = ["trainer.steps=3", "trainer.save_every=1", "rollout.prompts_per_step=2", "rollout.group_size=4",
          "trainer.micro_batch_size=2", "data.heldout_size=4", "data.train_size=20", "rollout.max_tokens=16",
          "rollout.eval_max_tokens=8", "trainer.progress_bar=false", "trainer.eval_before=false",
          "rollout.kv_cache_gib=0.25", "trainer.collective_timeout_s=10"]


def _left(tag: str) -> list[int]:
    """Live processes (not zombies) whose environment carries ``MEGALIGN_TEST_TAG=tag``."""
    found = []
    for p in psutil.process_iter():
        try:
            if p.status() != psutil.STATUS_ZOMBIE and p.environ().get("MEGALIGN_TEST_TAG") == tag:
                found.append(p.pid)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return found


def _launch(model, out: Path, point: str, step: int, tmp: Path) -> tuple[int, dict, float, str]:
    """One launch; returns ``(status, failures, seconds from the failure to the end, tag)``."""
    from tools import cli

    tag = uuid.uuid4().hex
    failures: dict = {}
    status = cli.launch(WORKER, [str(model), str(out), point, str(step), *COMMON, str(tmp / f"{point}.json")],
                        nproc=2, env={"MEGALIGN_TEST_TAG": tag, "PYTHONPATH": str(ROOT)}, failures=failures)
    ended = time.time()
    failed_at = out / "failed_at"
    waited = ended - float(failed_at.read_text()) if failed_at.exists() else 0.0
    if os.environ.get("MEGALIGN_FIGURES"):  # docs/reliability.md's figures: one line per launch
        with open(os.environ["MEGALIGN_FIGURES"], "a") as f:
            f.write(json.dumps({"point": point, "status": status, "seconds_to_end": waited,
                                "report": failure_report(failures, out, 10) if failures else None}) + "\n")
    failed_at.unlink(missing_ok=True)
    deadline = time.monotonic() + 10  # what the launcher killed last may still be going
    while _left(tag) and time.monotonic() < deadline:
        time.sleep(0.2)
    return status, failures, waited, tag


# heavy (CI time): the kills inside the rollout and inside a collective of the training phase, and the hung
# rank; the kill during a checkpoint (its report and the resume, below) runs everywhere
@pytest.mark.heavy(
    cheap="tests/test_rank_failure.py::test_a_rank_killed_while_checkpointing_and_the_same_command_resumes")
@pytest.mark.parametrize("point,phase", [("rollout", "rollout"), ("collective", "training")])
def test_a_rank_killed_ends_the_job_within_a_minute_named_with_its_phase(tmp_path, point, phase):
    model, out = save_tiny_hf_dir(tmp_path / "tiny"), tmp_path / "run"
    status, failures, waited, tag = _launch(model, out, point, 1, tmp_path)
    assert status != 0 and failures[1][1] == -9, failures
    assert waited < 60, waited
    assert _left(tag) == []
    pid = read_phases(out)[1]["pid"]
    report = failure_report(failures, out, 10)
    assert report == (f"rank 1 (pid {pid} on {os.uname().nodename}) was killed by SIGKILL during the {phase} of step "
                      "2; the other ranks were stopped"), report


def test_a_rank_killed_while_checkpointing_and_the_same_command_resumes(tmp_path):
    model, out = save_tiny_hf_dir(tmp_path / "tiny"), tmp_path / "run"
    status, failures, waited, tag = _launch(model, out, "checkpoint", 1, tmp_path)
    assert status != 0 and failures[1][1] == -9 and waited < 60 and _left(tag) == [], (failures, waited)
    assert "was killed by SIGKILL during the checkpoint of step 2" in failure_report(failures, out, 10)
    ckpt = out / "checkpoints"
    assert sorted(d.name for d in ckpt.iterdir()) == ["step_1", "step_2.tmp"]  # step_2 never published
    status, failures, _, tag = _launch(model, out, "none", -1, tmp_path)
    assert status == 0 and not failures and _left(tag) == []
    summary = json.loads((tmp_path / "none.json").read_text())
    assert summary["start_step"] == 1 and len(summary["history"]) == 2


@pytest.mark.heavy(cheap="tests/test_job_guard.py::test_failure_report_names_the_rank_and_its_phase")
def test_a_hung_rank_ends_the_job_at_the_collective_timeout_named(tmp_path):
    model, out = save_tiny_hf_dir(tmp_path / "tiny"), tmp_path / "run"
    status, failures, waited, tag = _launch(model, out, "hang", 1, tmp_path)
    assert status != 0 and 10 <= waited < 60 and _left(tag) == [], (failures, waited)
    phases = read_phases(out)
    report = failure_report(failures, out, 10)
    assert report.startswith(f"rank 1 (pid {phases[1]['pid']} on {os.uname().nodename}) during the rollout of step 2 "
                             f"stopped answering: rank 0 (pid {phases[0]['pid']} on {os.uname().nodename}) waited "
                             "trainer.collective_timeout_s=10 s in a collective during the "), report
