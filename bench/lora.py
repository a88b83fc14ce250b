"""Full fine-tuning against LoRA, side by side in one invocation: the main job (GRPO, SmolLM2-135M,
arithmetic, 8 prompts x 8 samples, seed 1234, ``configs/grpo.yaml``) and the same job with
rank-16 adapters (``configs/grpo_lora.yaml``), then a table of held-out accuracy before and after,
peak resident memory per rank, and step and phase times with their ratios.

    python bench/lora.py [--steps 12] [--nproc 2]

Both runs build a reference for the KL term: full fine-tuning a second model, LoRA none (the
policy with its adapters off), so the memory column includes that saving as well as the frozen
base's missing gradients and Adam state.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.async_rl import PHASES, medians, run_mode  # noqa: E402

MODES = {"full fine-tuning": [], "LoRA r=16": ["--config-name=grpo_lora"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--nproc", type=int, default=2)
    args = ap.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for i, (name, overrides) in enumerate(MODES.items()):
            results[name] = run_mode(overrides, args.steps, args.nproc, Path(tmp) / f"mode{i}")
    base = results["full fine-tuning"]
    print(f"\nGRPO, SmolLM2-135M, {args.nproc} processes, {args.steps} steps, medians after the first step")
    print("| run | held-out before | after | peak RSS GiB per rank | vs full | step s | vs full | "
          + " | ".join(f"{k} s" for k in PHASES) + " |")
    print("|---|---|---|---|---|---|---|" + "---|" * len(PHASES))
    peak = {n: max(m["peak_rss_gib"] for m in s["memory"]) for n, s in results.items()}
    for name, s in results.items():
        m, b = medians(s), medians(base)
        ranks = " / ".join(f"{r['peak_rss_gib']:.2f}" for r in s["memory"])
        print(f"| {name} | {s['heldout_accuracy_before']:.1%} | {s['heldout_accuracy_after']:.1%} | {ranks} | "
              f"{peak[name] / peak['full fine-tuning']:.2f}x | {m['step']:.1f} | {m['step'] / b['step']:.2f}x | "
              + " | ".join(f"{m[k]:.2f}" for k in PHASES) + " |")
    kl = {n: statistics.median(h["kl"] for h in s["history"][1:]) for n, s in results.items()}
    print("median KL to the reference: " + ", ".join(f"{n} {v:.2e}" for n, v in kl.items()))


if __name__ == "__main__":
    sys.exit(main())
