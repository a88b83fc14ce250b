"""Synchronous, one-step off-policy and disaggregated GRPO, side by side in one invocation: the main job
(SmolLM2-135M, arithmetic, 8 prompts x 8 samples, seed 1234) once per mode, then a table of step
time, samples/s, phase times and held-out accuracy, and a pipeline model of what the same phases
would give on a cluster with rollout ranks of their own.

    python bench/async_rl.py [--steps 12] [--nproc 2] [--workload main|long-tail] [--modes ...]

Workloads: ``main`` (answers up to 48 tokens), ``long-tail`` (the same task with answers up to 256
tokens, GSM8K's length: most answers stay short and a few ramble to the cap, holding the batch up;
fp32, a KV cache for the longer rows).

Modes (``rollout.max_staleness``, :mod:`launchers.loop`):
  sync            0: each step samples its own batch, then trains on it (on-policy)
  one-step-off    1: step s+1's batch is sampled before step s trains; the loss weights each
                     token by min(pi_old / pi_rollout, 2) (``algorithm.rollout_correction.is_level=token``)
  disaggregated   ``rollout.placement=disaggregated rollout.rollout_ranks=1``: the last process
                  only runs the vLLM engine, the others only train (2 processes: 1 + 1), with
                  ``max_staleness`` 0 (the trainer waits for every rollout) and 1 (step s+1's batch
                  is generated on the engine's core while step s trains on the trainer's)
  disaggregated partial   one-step-off with ``rollout.partial=true``: the engine takes step s's
                  new weights between two decode chunks of step s+1's batch and continues the
                  unfinished answers under them (``alignment/rollout/engines/partial.py``), in the default
                  chunks of 32 tokens (``rollout.partial_chunk_tokens``); ``disaggregated partial chunk32``
                  names the 32 explicitly (the default was 8 before 2026-11-27)
  partial carried   colocated, ``rollout.partial=true rollout.partial_carry_over=true`` with one-step-off's
                  staleness: the next step's prompts are admitted ahead, each step trains the groups that
                  finished first and the unfinished ones go on in the next steps under the next weights
                  (``alignment/rollout/engines/carryover.py``), in chunks of 32 tokens
  disaggregated partial carried   the same with the pools on the rollout rank, whose rows keep growing
                  while the trainer trains (``alignment/rollout/engines/carried_remote.py``)

What 2 cores can show: whether training on one-step-old samples learns as well (accuracy), what
each phase costs, and a disaggregated split of the cores (1 training, 1 generating) against
the colocated job's 2 cores taking turns. What they cannot: a cluster's gain. The engine and the trainer of a colocated job take
turns on the same cores, so sampling ahead only changes which policy sampled a batch; the
disaggregated job overlaps the two sides, but each side has half the cores. The pipeline model
below predicts the disaggregated step from the synchronous run's phases (medians, first step
skipped as warm-up) in two regimes, so the measured disaggregated rows say which regime this
machine's generation is in, and what a cluster's would give.
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
OFF_POLICY = ["rollout.max_staleness=1", "algorithm.rollout_correction.is_level=token"]
SPLIT = ["rollout.placement=disaggregated", "rollout.rollout_ranks=1"]
MODES = {"sync": [], "one-step-off": OFF_POLICY, "disaggregated sync": SPLIT,
         "disaggregated one-step-off": SPLIT + OFF_POLICY,
         "disaggregated partial": SPLIT + OFF_POLICY + ["rollout.partial=true"],
         "disaggregated partial chunk32": SPLIT + OFF_POLICY + ["rollout.partial=true", "rollout.partial_chunk_tokens=32"],
         "partial carried": OFF_POLICY + ["rollout.partial=true", "rollout.partial_carry_over=true"],
         "disaggregated partial carried": SPLIT + OFF_POLICY + ["rollout.partial=true", "rollout.partial_carry_over=true"]}
PHASES = ("rollout", "logprobs", "train", "weight_sync")
WORKLOADS = {"main": [], "long-tail": ["rollout.max_tokens=256", "rollout.eval_max_tokens=256", "rollout.kv_cache_gib=1",
                                      "model.dtype=float32"]}


def run_mode(overrides: list[str], steps: int, nproc: int, out: Path) -> dict:
    """The main job with ``overrides`` for ``steps`` steps (held-out evaluation before and after,
    no checkpoint or export); returns its summary.json."""
    cmd = ["torchrun", "--standalone", f"--nproc-per-node={nproc}", str(ROOT / "launchers/train.py"),
           f"trainer.steps={steps}", "trainer.save_checkpoint=false", "trainer.export_hf=false",
           "trainer.progress_bar=false", f"output_dir={out}", *overrides]
    subprocess.run(cmd, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=ROOT)
    return json.loads((out / "summary.json").read_text())


def medians(summary: dict) -> dict[str, float]:
    """Median step and phase seconds over the steps after the first, and (rollout ranks of their
    own) the engine's idle seconds per step, the response length and the token staleness."""
    hist = summary["history"][1:] or summary["history"]
    out = {k: statistics.median(m[f"time/{k}"] for m in hist) for k in ("step", *PHASES)}
    for key in ("rollout/engine_idle_s", "response_length", "rollout/token_staleness"):
        values = [m[key] for m in hist if key in m]
        out[key] = statistics.median(values) if values else float("nan")
    return out


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
    ap.add_argument("--modes", default=",".join(MODES), help="comma-separated subset of " + ", ".join(MODES)
                    + "; the first is the baseline")
    ap.add_argument("--workload", default="main", choices=sorted(WORKLOADS))
    ap.add_argument("--heldout", type=int, default=0, help="data.heldout_size (0: the config's 200)")
    ap.add_argument("--fp32", action="store_true", help="model.dtype=float32 (CPUs without AVX-512-BF16)")
    args = ap.parse_args()
    modes = args.modes.split(",")
    if not set(modes) <= set(MODES):
        ap.error(f"--modes={args.modes}: any of {', '.join(MODES)}")
    extra = (WORKLOADS[args.workload] + ([f"data.heldout_size={args.heldout}"] if args.heldout else [])
             + (["model.dtype=float32"] if args.fp32 else []))
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in modes:
            results[name] = run_mode(MODES[name] + extra, args.steps, args.nproc, Path(tmp) / name.replace(" ", "_"))
    samples = 8 * 8  # configs/grpo.yaml: prompts_per_step x group_size
    base = medians(results[modes[0]])["step"]
    print(f"\nGRPO, SmolLM2-135M, {args.workload} workload, {args.nproc} processes, {args.steps} steps, medians "
          "after the first step")
    print(f"| mode | step s | samples/s | vs {modes[0]} | rollout s | logprobs s | train s | sync s | engine idle s "
          "| response tokens | token staleness | held-out before | after |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name, summary in results.items():
        m = medians(summary)
        print(f"| {name} | {m['step']:.1f} | {samples / m['step']:.2f} | {base / m['step']:.2f}x | "
              + " | ".join(f"{m[k]:.2f}" for k in (*PHASES, "rollout/engine_idle_s", "response_length",
                                                     "rollout/token_staleness"))
              + f" | {summary['heldout_accuracy_before']:.1%} | {summary['heldout_accuracy_after']:.1%} |")
    if "sync" not in results:
        return
    print(f"\nPipeline model from the sync run's phases (pipeline_model; rollout share {args.rollout_share};"
          " the disaggregated rows above are this model's 'f=0.50' rows measured):")
    model = pipeline_model(medians(results["sync"]), args.rollout_share)
    colocated = model["colocated, synchronous"]
    print("| layout | step s | vs colocated |\n|---|---|---|")
    for layout, seconds in model.items():
        print(f"| {layout} | {seconds:.1f} | {colocated / seconds:.2f}x |")


if __name__ == "__main__":
    sys.exit(main())
