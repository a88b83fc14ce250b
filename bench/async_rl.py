"""Synchronous against one-step off-policy GRPO, side by side in one invocation: the main job
(SmolLM2-135M, arithmetic, 8 prompts x 8 samples, seed 1234) once per mode, then a table of step
time, samples/s, phase times and held-out accuracy, and a pipeline model of what the same phases
would give on a cluster with rollout ranks of their own.

    python bench/async_rl.py [--steps 12] [--nproc 2]

Modes (``rollout.max_staleness``, :mod:`launchers.rl_loop`):
  sync            0: each step samples its own batch, then trains on it (on-policy)
  one-step-off    1: step s+1's batch is sampled before step s trains; the loss weights each
                     token by min(pi_old / pi_rollout, 2) (``algorithm.rollout_correction.is_level=token``)
Disaggregated placement (rollout ranks apart from training ranks) is not built yet.

What 2 cores can show: whether training on one-step-old samples learns as well (accuracy), and
what each phase costs. What they cannot: a speed-up. The engine and the trainer of a colocated
job take turns on the same cores, so sampling ahead only changes which policy sampled a batch;
overlapping generation with training needs devices of their own. The pipeline model below
estimates that from the measured phase times (medians, first step skipped as warm-up).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODES = {"sync": [], "one-step-off": ["rollout.max_staleness=1", "algorithm.rollout_correction.is_level=token"]}
PHASES = ("rollout", "logprobs", "train", "weight_sync")


def run_mode(overrides: list[str], steps: int, nproc: int, out: Path) -> dict:
    """The main job with ``overrides`` for ``steps`` steps (held-out evaluation before and after,
    no checkpoint or export); returns its summary.json."""
    cmd = ["torchrun", "--standalone", f"--nproc-per-node={nproc}", str(ROOT / "launchers/train.py"),
           f"trainer.steps={steps}", "trainer.save_checkpoint=false", "trainer.export_hf=false",
           "trainer.progress_bar=false", f"output_dir={out}", *overrides]
    subprocess.run(cmd, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=ROOT)
    return json.loads((out / "summary.json").read_text())


def medians(summary: dict) -> dict[str, float]:
    """Median step and phase seconds over the steps after the first."""
    hist = summary["history"][1:] or summary["history"]
    return {k: statistics.median(m[f"time/{k}"] for m in hist) for k in ("step", *PHASES)}


def pipeline_model(t: dict[str, float], rollout_share: float) -> dict[str, float]:
    """Step seconds on a cluster of G devices, from the phase seconds ``t`` measured on all G
    (R rollout, B = logprobs + train, S weight sync), two regimes bracketing real generation:

    - colocated, synchronous: ``R + B + S`` (the phases take turns on every device);
    - disaggregated, one step off-policy, a share ``f`` of the devices generating step s+1 while
      the rest trains step s (``B / (1 - f)``), the sync on the critical path:
      * generation scaling with its devices (compute-bound: ``R / f``):
        ``max(R / f, B / (1 - f)) + S``; at the best share ``f* = R / (R + B)`` this equals the
        colocated step: splitting the devices only moves work around;
      * generation time independent of its devices (memory-bound decode: each step of the
        longest sample costs about the same whatever the batch, until the batch saturates the
        device): ``max(R, B / (1 - f)) + S``, at best ``max(R, B) + S``.
    Real generation lies in between; what this leaves out favours disaggregation further
    (engine sleep/wake and offload between colocated phases, the long tail of generation).
    """
    r, b, s = t["rollout"], t["logprobs"] + t["train"], t["weight_sync"]
    f = rollout_share
    best = r / (r + b) if r + b > 0 else 0.5
    return {"colocated, synchronous": r + b + s,
            f"disaggregated 1-off, compute-bound generation, f={f:.2f}": max(r / f, b / (1 - f)) + s,
            f"disaggregated 1-off, compute-bound generation, best f={best:.2f}": max(r / best, b / (1 - best)) + s,
            f"disaggregated 1-off, memory-bound decode, f={f:.2f}": max(r, b / (1 - f)) + s,
            "disaggregated 1-off, memory-bound decode, best f": max(r, b) + s}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--rollout-share", type=float, default=0.5, help="pipeline model: share of devices generating")
    args = ap.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, overrides in MODES.items():
            results[name] = run_mode(overrides, args.steps, args.nproc, Path(tmp) / name)
    samples = 8 * 8  # configs/grpo.yaml: prompts_per_step x group_size
    base = medians(results["sync"])["step"]
    print(f"\nGRPO, SmolLM2-135M, {args.nproc} processes, {args.steps} steps, medians after the first step")
    print("| mode | step s | samples/s | vs sync | rollout s | logprobs s | train s | sync s | held-out before | after |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, summary in results.items():
        m = medians(summary)
        print(f"| {name} | {m['step']:.1f} | {samples / m['step']:.2f} | {base / m['step']:.2f}x | "
              + " | ".join(f"{m[k]:.2f}" for k in PHASES)
              + f" | {summary['heldout_accuracy_before']:.1%} | {summary['heldout_accuracy_after']:.1%} |")
    print("| disaggregated | not built yet (issue 15 item 3) | | | | | | | | |")
    print(f"\nPipeline model from the sync run's phases (pipeline_model; rollout share {args.rollout_share}):")
    model = pipeline_model(medians(results["sync"]), args.rollout_share)
    colocated = model["colocated, synchronous"]
    print("| layout | step s | vs colocated |\n|---|---|---|")
    for layout, seconds in model.items():
        print(f"| {layout} | {seconds:.1f} | {colocated / seconds:.2f}x |")


if __name__ == "__main__":
    sys.exit(main())
