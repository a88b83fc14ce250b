"""Start-up on a first run: how long ``megalign train`` takes from launch to the first training step.

Runs the main job (``configs/grpo.yaml``, 2 processes) ``--runs`` times one after another, each in a new output
directory and with the base model's held-out accuracy not cached (``trainer.eval_cache=false``: the before-training
evaluation is measured, beside step 1 by default). For each run it records:

- when the ranks started after the command was launched (the command's own config and input checks), found by
  polling the command's child processes for ``launchers/train.py``;
- each rank's time from its process start to its first training step (``startup_s`` in ``summary.json``,
  :func:`launchers.loop.run`);
- their sum, launch -> first step (issue 43's target: <= 20 s), and the held-out accuracy before and after.

    python bench/startup.py [--runs 3] [--steps 2] [--out outputs/startup] [key=value overrides ...]

The default overrides are the measured ones (``model.dtype=float32``); more are passed to every run.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
TRAIN_SCRIPT = ROOT / "launchers" / "train.py"  # what each rank runs (tools/cli.py launches it)

DEFAULT_OVERRIDES = ["model.dtype=float32"]


def ranks_started(pid: int, seen: dict[int, float], launched: float) -> None:
    """Add to ``seen`` every rank process (``launchers/train.py``) under ``pid`` not yet seen:
    ``{pid: seconds after launched}``."""
    try:
        children = psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return
    for child in children:
        try:
            if child.pid not in seen and str(TRAIN_SCRIPT) in child.cmdline():
                seen[child.pid] = child.create_time() - launched
        except psutil.Error:  # gone between the listing and the read
            continue


def one_run(out: Path, steps: int, overrides: list[str]) -> dict:
    """Launch ``megalign train --nproc 2`` once; returns the run's figures (seconds)."""
    shutil.rmtree(out, ignore_errors=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "tools.cli", "train", "--nproc", "2", "--config-name", "grpo",
           f"trainer.steps={steps}", "trainer.eval_cache=false", f"output_dir={out}", *overrides]
    seen: dict[int, float] = {}
    with open(f"{out}.log", "w") as log:
        launched = time.time()
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        while proc.poll() is None:
            ranks_started(proc.pid, seen, launched)
            time.sleep(0.05)
    if proc.returncode:
        raise SystemExit(f"the run failed (exit status {proc.returncode}): see {out}.log")
    summary = json.loads((out / "summary.json").read_text())
    if not seen:
        raise SystemExit(f"no rank process ({TRAIN_SCRIPT}) was seen under the command: see {out}.log")
    cli_s = min(seen.values())
    return {"cli_s": cli_s, "rank_s": summary["startup_s"], "total_s": cli_s + summary["startup_s"],
            "before": summary.get("heldout_accuracy_before"), "after": summary.get("heldout_accuracy_after")}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--out", default="outputs/startup")
    args, overrides = p.parse_known_args(argv)
    rows = [one_run(Path(args.out) / f"run{i}", args.steps, DEFAULT_OVERRIDES + overrides) for i in range(args.runs)]
    print("| run | launch -> ranks start (s) | rank start -> first step (s) | launch -> first step (s) "
          "| held-out before / after |")
    print("|---|---|---|---|---|")
    for i, r in enumerate(rows):
        print(f"| {i + 1} | {r['cli_s']:.1f} | {r['rank_s']:.1f} | {r['total_s']:.1f} | {r['before']} / {r['after']} |")
    print(f"worst launch -> first step: {max(r['total_s'] for r in rows):.1f} s (target <= 20 s)")


if __name__ == "__main__":
    main()
