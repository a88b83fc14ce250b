"""Asynchronous GRPO against synchronous at matched samples, over seeds: the four ways megalign feeds a
trainer on 1 trainer + 1 vLLM rank (``rollout.placement=disaggregated rollout.rollout_ranks=1``), each
run for the same steps (every step trains ``prompts_per_step x group_size`` samples) under each seed,
with the held-out accuracy measured every ``--eval-every`` steps. Prints the step-time table, the
held-out accuracy at each point (mean and range over the seeds) and whether each mode's mean lies within
the synchronous seeds' range there, and plots accuracy against samples trained and against wall time.

    python bench/async_accuracy.py [--workload long-tail|gsm8k] [--seeds 1,2,3] [--steps 6] [--eval-every 2]
        [--heldout 50] [--dtype float32|bfloat16] [--out outputs/async_accuracy] [--plot docs/img/async_accuracy_long_tail.png] [--replot]

Modes (``bench/async_rl.py``'s, all disaggregated):
  sync                 ``max_staleness=0``: the trainer waits for each step's batch
  one-step off         ``max_staleness=1``: step s+1's batch is generated while step s trains, token-level TIS
  partial within step  one-step off, the engine takes new weights between chunks of 32 tokens
  partial carried      one-step off, unfinished groups carried into the next steps under the next weights

Wall time is the sum of the steps' own seconds (held-out evaluations and start-up left out). The runs'
summaries are kept in ``--out/<workload>.json``; ``--replot`` redraws and reprints from it without running.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.async_rl import MODES as ASYNC_MODES, WORKLOADS as ASYNC_WORKLOADS, run_mode  # noqa: E402

MODES = {"sync": "disaggregated sync", "one-step off": "disaggregated one-step-off",
         "partial within step": "disaggregated partial", "partial carried": "disaggregated partial carried"}
#: workload -> (overrides, samples trained per step: the job's prompts_per_step x group_size)
WORKLOADS = {"long-tail": (ASYNC_WORKLOADS["long-tail"], 8 * 8),
             "gsm8k": (["--config-name=grpo_gsm8k"], 4 * 8)}


def curve(summary: dict, samples_per_step: int) -> list[tuple[int, float, float]]:
    """(samples trained, wall seconds, held-out accuracy) before the first step, at every step that
    evaluated, and after the last: the wall seconds are the steps' own, summed."""
    points, wall = [(0, 0.0, summary["heldout_accuracy_before"])], 0.0
    history = summary["history"]
    for i, metrics in enumerate(history, start=1):
        wall += metrics["time/step"]
        if "heldout/accuracy" in metrics and i < len(history):
            points.append((i * samples_per_step, wall, metrics["heldout/accuracy"]))
    points.append((len(history) * samples_per_step, wall, summary["heldout_accuracy_after"]))
    return points


def spread(values: list[float]) -> str:
    """Accuracies (fractions in [0, 1]) as "mean % (min-max %)"; raises StatisticsError when empty."""
    return f"{statistics.mean(values):.1%} ({min(values):.0%}-{max(values):.0%})"


def step_means(summary: dict) -> dict[str, float]:
    """Means over the steps after the first (the first compiles and fills the pipeline) of the step and
    rollout-wait seconds, the engine's idle seconds, the trained answers' length in tokens (the trainer's
    work grows with it) and the token staleness; the restarted rows summed."""
    hist = summary["history"][1:] or summary["history"]
    mean = lambda key: statistics.mean(m.get(key, 0.0) for m in hist)  # noqa: E731
    return {"step": mean("time/step"), "wait": mean("time/rollout"), "idle": mean("rollout/engine_idle_s"),
            "tokens": mean("response_length"),
            "staleness": mean("rollout/token_staleness"),
            "restarted": sum(m.get("rollout/restarted_rows", 0) for m in summary["history"])}


def report(runs: dict[str, list[dict]], samples_per_step: int, title: str) -> list[str]:
    """The markdown tables: step times (means over seeds of each run's means after its first step: a
    median would hide the steps that wait), then held-out accuracy at each point, mean (range) over
    seeds, and the comparison with sync's range."""
    base = statistics.mean(step_means(s)["step"] for s in runs["sync"])
    lines = [title, "", "| mode | step s (range) | vs sync | trainer waits s | engine idle s | token staleness "
             "| restarted rows | answer tokens | held-out after |", "|---|---|---|---|---|---|---|---|---|"]
    for name, summaries in runs.items():
        m = [step_means(s) for s in summaries]
        mean = lambda key: statistics.mean(x[key] for x in m)  # noqa: E731
        steps = [x["step"] for x in m]
        lines.append(f"| {name} | {mean('step'):.1f} ({min(steps):.1f}-{max(steps):.1f}) | {base / mean('step'):.2f}x "
                     f"| {mean('wait'):.2f} | {mean('idle'):.2f} | {mean('staleness'):.2f} | {mean('restarted'):.1f} "
                     f"| {mean('tokens'):.1f} "
                     f"| {spread([s['heldout_accuracy_after'] for s in summaries])} |")
    curves = {name: [curve(s, samples_per_step) for s in summaries] for name, summaries in runs.items()}
    points = [p[0] for p in curves["sync"][0]]
    lines += ["", "| samples trained | " + " | ".join(curves) + " |", "|---" * (len(curves) + 1) + "|"]
    for j, n in enumerate(points):
        lines.append(f"| {n} | " + " | ".join(spread([c[j][2] for c in cs]) for cs in curves.values()) + " |")
    sync = [[c[j][2] for c in curves["sync"]] for j in range(len(points))]
    for name, cs in curves.items():
        if name == "sync":
            continue
        outside = [n for j, n in enumerate(points) if j and not min(sync[j]) <= statistics.mean(c[j][2] for c in cs)
                   <= max(sync[j])]
        lines.append(f"\n{name}: mean held-out accuracy " + ("within the sync seeds' range at every point" if not outside
                     else "outside the sync seeds' range at " + ", ".join(f"{n} samples" for n in outside)))
    return lines


def plot(runs: dict[str, list[dict]], samples_per_step: int, title: str, path: Path) -> None:
    """Two panels, mean over seeds with the seeds' range shaded: held-out accuracy against samples
    trained, and against wall seconds (each point at the seeds' mean time)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6), sharey=True)
    for name, summaries in runs.items():
        cs = [curve(s, samples_per_step) for s in summaries]
        n = len(cs[0])
        x_samples = [cs[0][j][0] for j in range(n)]
        x_wall = [statistics.mean(c[j][1] for c in cs) for j in range(n)]
        acc = [[100 * c[j][2] for c in cs] for j in range(n)]
        mean = [statistics.mean(a) for a in acc]
        for ax, x in zip(axes, (x_samples, x_wall)):
            (line,) = ax.plot(x, mean, marker="o", label=name)
            ax.fill_between(x, [min(a) for a in acc], [max(a) for a in acc], color=line.get_color(), alpha=0.15)
    axes[0].set_xlabel("samples trained")
    axes[1].set_xlabel("wall seconds (steps only)")
    axes[0].set_ylabel("held-out accuracy (%)")
    axes[1].legend(loc="lower right")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", default="long-tail", choices=sorted(WORKLOADS))
    ap.add_argument("--seeds", default="1,2,3")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--eval-every", type=int, default=2, help="trainer.eval_every")
    ap.add_argument("--heldout", type=int, default=50, help="data.heldout_size")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"],
                    help="model.dtype (default: the workload's: long-tail float32, gsm8k the config's bfloat16)")
    ap.add_argument("--modes", default=",".join(MODES), help="comma-separated subset of " + ", ".join(MODES)
                    + "; must include sync")
    ap.add_argument("--out", type=Path, default=ROOT / "outputs" / "async_accuracy")
    ap.add_argument("--plot", type=Path, help="PNG to write (default: --out/<workload>.png)")
    ap.add_argument("--replot", action="store_true", help="reuse --out/<workload>.json, run nothing")
    args = ap.parse_args()
    modes = args.modes.split(",")
    if "sync" not in modes or not set(modes) <= set(MODES):
        ap.error(f"--modes={args.modes}: sync and any of {', '.join(MODES)}")
    overrides, samples_per_step = WORKLOADS[args.workload]
    seeds = [int(s) for s in args.seeds.split(",")]
    saved = args.out / f"{args.workload}.json"
    if args.replot:
        record = json.loads(saved.read_text())
    else:
        extra = [*overrides, f"data.heldout_size={args.heldout}", f"trainer.eval_every={args.eval_every}",
                 *([f"model.dtype={args.dtype}"] if args.dtype else [])]
        record = {"args": {k: str(v) for k, v in vars(args).items()}, "runs": {name: [] for name in modes}}
        args.out.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory() as tmp:
            for seed in seeds:  # seeds outermost: a cut-short study still compares the modes on the seeds done
                for name in modes:
                    out = Path(tmp) / f"{name.replace(' ', '_')}_{seed}"
                    summary = run_mode(ASYNC_MODES[MODES[name]] + extra + [f"seed={seed}"], args.steps, 2, out)
                    record["runs"][name].append(summary)
                    saved.write_text(json.dumps(record))  # after every run: nothing measured is lost
    a = record["args"]
    title = (f"GRPO, SmolLM2-135M, {args.workload}, 1 trainer + 1 vLLM rank, {a['steps']} steps x {samples_per_step} "
             f"samples, seeds {a['seeds']}, {a['heldout']} held-out problems"
             + (f", {a['dtype']}" if a.get("dtype", "None") != "None" else ""))
    runs = {name: summaries for name, summaries in record["runs"].items() if summaries}  # modes not reached left out
    print("\n".join(report(runs, samples_per_step, title)))
    plot(runs, samples_per_step, title, args.plot or args.out / f"{args.workload}.png")


if __name__ == "__main__":
    sys.exit(main())
