"""A full disk during a checkpoint (alignment/training/checkpoint.py's ``ensure_space``): a real 2-rank
SFT job writes into a 64 MiB tmpfs mounted for the test; its first checkpoint fits, the second does not.
The save is refused before it writes anything, with the space it needed and the space free; the job
ends with that one line; the first checkpoint stays complete and the same command would resume from
it. Skipped where no tmpfs can be mounted (not root)."""

from __future__ import annotations

import re
import subprocess

import pytest
from transformers import AutoConfig

from alignment.models.families import model_dims

from alignment.training.checkpoint import latest_checkpoint, verify_checkpoint
from parallel.memory import checkpoint_bytes
from tests.dist.tiny_llama import save_tiny_hf_dir

pytestmark = pytest.mark.slow  # launches processes: the full suite only (CONTRIBUTING.md, test tiers)


@pytest.fixture
def small_disk(tmp_path):
    """A 64 MiB tmpfs at ``tmp_path / "small"``, unmounted afterwards."""
    mount = tmp_path / "small"
    mount.mkdir()
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(mount)], capture_output=True)
    if made.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {made.stderr.decode().strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def test_a_full_disk_stops_the_run_before_the_save_and_keeps_the_last_checkpoint(tmp_path, small_disk, capfd):
    from tools import cli

    model, out = save_tiny_hf_dir(tmp_path / "tiny"), small_disk / "run"
    args = ["--config-name=sft", f"model.path={model}", f"output_dir={out}", "trainer.steps=3", "trainer.save_every=1",
            "data.train_size=16", "data.heldout_size=4", "trainer.global_batch_size=4", "trainer.micro_batch_size=2",
            "data.max_length=64", "data.max_prompt_length=32", "trainer.eval_before=false", "trainer.export_hf=false",
            "trainer.progress_bar=false"]
    capfd.readouterr()
    assert cli.train(["--nproc", "2", *args]) == 2
    err = capfd.readouterr().err.strip().splitlines()
    assert err[-1].startswith("megalign: error: checkpoint step_2: about ") and " MiB needed in " in err[-1], err
    needed, free = map(float, re.search(r"about ([\d.,]+) MiB needed in .*?, ([\d.,]+) MiB free", err[-1]).groups())
    step_1 = out / "checkpoints" / "step_1"
    written = sum(p.stat().st_size for p in step_1.rglob("*") if p.is_file()) / 2**20
    assert needed == pytest.approx(written, abs=0.1) and free < needed, (needed, free, written)
    # the first save was checked against the planner's estimate: within 5 % of what it wrote
    dims = model_dims(AutoConfig.from_pretrained(model))
    assert checkpoint_bytes(dims, dtype="bfloat16") / 2**20 == pytest.approx(written, rel=0.05), written
    assert "step_1 is complete and the same command resumes from it" in err[-1]
    assert latest_checkpoint(out / "checkpoints") == step_1
    verify_checkpoint(step_1)  # every file there, its size as written
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_1"]  # nothing of step_2 written
    assert cli.train(["--dry-run", "--nproc", "2", *args]) == 0  # the same command would resume from step_1
