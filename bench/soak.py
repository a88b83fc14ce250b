"""Soak: a long GRPO run (2 ranks, the in-process vLLM engine, a tiny random Llama, short answers, a
reward that varies so that every step updates the weights: :func:`even_length`)
watched from outside at every optimizer step: each rank's resident memory (RSS), open file
descriptors, threads and child processes, and the size of ``output_dir`` (checkpoints every
``--save-every`` steps, ``trainer.keep_last=2``). Prints the figures after a warm-up (the RSS
slope in MB per step by least squares, target <= 0.5; the ranges of the others, which should be
flat) and writes the samples (``soak.jsonl``), the job's output (``soak.log``) and a plot of RSS per
step (``soak_rss.png``).

    python bench/soak.py [--steps 300] [--out outputs/soak] [--warmup 30]

A step is seen when a rank's phase record (``<output_dir>/logs/rank<r>.phase``,
:mod:`launchers.phase_log`) moves to the next step's rollout; the sample is taken then, from
``psutil``, with the rank between steps.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from alignment.models.hf_assets import prepare_hf_dir  # noqa: E402
from launchers.phase_log import read_phases  # noqa: E402

JOB = ["rollout.prompts_per_step=2", "rollout.group_size=4", "trainer.micro_batch_size=2", "data.heldout_size=4",
       "data.train_size=200", "rollout.max_tokens=16", "rollout.eval_max_tokens=8", "trainer.progress_bar=false",
       "trainer.eval_before=false", "rollout.kv_cache_gib=0.25", "trainer.keep_last=2", "trainer.eval_cache=false",
       "trainer.lr=1e-4", "reward.functions=[{name: bench.soak:even_length}]"]


def even_length(completions, **kwargs) -> list[float]:
    """The soak's reward (``reward.functions``, TRL's signature): 1.0 for a completion with an even
    number of characters. It varies within every group, so every step has advantages, gradients and
    an update (a random model never solves the task, whose grader would give 0 everywhere)."""
    return [float(len(c if isinstance(c, str) else c[-1]["content"]) % 2 == 0) for c in completions]


def tiny_model(path: Path) -> Path:
    """A random 4-layer Llama (hidden 64) with SmolLM2's tokenizer and chat template, as an HF directory."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(prepare_hf_dir("smollm2"))
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=80, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
                         tie_word_embeddings=True, eos_token_id=tokenizer.eos_token_id)
    LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def directory_mb(path: Path) -> float:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) / 1e6 if path.exists() else 0.0


def sample(pid: int) -> dict:
    """One rank's process figures now."""
    p = psutil.Process(pid)
    with p.oneshot():
        return {"rss_mb": p.memory_info().rss / 1e6, "fds": p.num_fds(), "threads": p.num_threads(),
                "children": len(p.children(recursive=True))}


def watch(out: Path, done: threading.Event, samples: list) -> None:
    """Sample every rank once per step until ``done``."""
    seen: dict[int, int] = {}
    while not done.is_set():
        for rank, rec in read_phases(out).items():
            if rec.get("phase") == "rollout" and rec.get("step", 0) > seen.get(rank, 0):
                seen[rank] = rec["step"]
                try:
                    samples.append({"rank": rank, "step": rec["step"] - 1, **sample(rec["pid"]),
                                    "output_dir_mb": directory_mb(out)})
                except psutil.NoSuchProcess:
                    pass
        time.sleep(0.05)


def slope(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of ``(x, y)`` points."""
    n = len(points)
    mx, my = sum(x for x, _ in points) / n, sum(y for _, y in points) / n
    return sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x, _ in points)


def report(samples: list[dict], warmup: int) -> str:
    """The Markdown table of the figures after ``warmup`` steps, one row per rank."""
    lines = ["| rank | steps | RSS at warm-up end (MB) | RSS slope (MB/step) | open fds | threads | children | "
             "output_dir (MB) |", "|---|---|---|---|---|---|---|---|"]
    for rank in sorted({s["rank"] for s in samples}):
        mine = [s for s in samples if s["rank"] == rank and s["step"] >= warmup]
        if len(mine) < 2:
            continue
        span = lambda k: f"{min(s[k] for s in mine):g}-{max(s[k] for s in mine):g}"  # noqa: E731
        disk = f"{min(s['output_dir_mb'] for s in mine):.0f}-{max(s['output_dir_mb'] for s in mine):.0f}"
        lines.append(f"| {rank} | {mine[0]['step']}-{mine[-1]['step']} | {mine[0]['rss_mb']:.0f} | "
                     f"{slope([(s['step'], s['rss_mb']) for s in mine]):+.3f} | {span('fds')} | {span('threads')} | "
                     f"{span('children')} | {disk} |")
    return "\n".join(lines)


def plot(samples: list[dict], path: Path, warmup: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.2))
    for rank in sorted({s["rank"] for s in samples}):
        mine = [s for s in samples if s["rank"] == rank]
        ax.plot([s["step"] for s in mine], [s["rss_mb"] for s in mine], label=f"rank {rank}")
    ax.axvline(warmup, color="grey", linestyle=":", label="end of warm-up")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("RSS (MB)")
    ax.set_title("GRPO soak: resident memory per step")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--warmup", type=int, default=30, help="steps left out of the figures")
    ap.add_argument("--save-every", type=int, default=25)
    ap.add_argument("--out", type=Path, default=ROOT / "outputs" / "soak")
    args = ap.parse_args(argv)
    shutil.rmtree(args.out, ignore_errors=True)
    args.out.mkdir(parents=True)
    model = tiny_model(args.out / "tiny")
    run = args.out / "run"
    samples: list[dict] = []
    done = threading.Event()
    watcher = threading.Thread(target=watch, args=(run, done, samples), daemon=True)
    watcher.start()
    t0 = time.time()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(ROOT / "launchers" / "train.py"), "--config-name=grpo", f"model.path={model}", f"output_dir={run}",
           f"trainer.steps={args.steps}", f"trainer.save_every={args.save_every}", *JOB]
    with open(args.out / "soak.log", "w") as log:
        status = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}, stdout=log,
                                stderr=subprocess.STDOUT).returncode
    done.set()
    watcher.join()
    (args.out / "soak.jsonl").write_text("".join(json.dumps(s) + "\n" for s in samples))
    plot(samples, args.out / "soak_rss.png", args.warmup)
    print(f"soak: {args.steps} steps in {time.time() - t0:.0f} s, exit status {status}, {len(samples)} samples\n")
    print(report(samples, args.warmup))
    summary = run / "summary.json"
    if summary.exists():  # the job's own record: did the steps train?
        history = json.loads(summary.read_text())["history"]
        moved = sum(h.get("grad_norm", 0.0) > 0 for h in history)
        print(f"\n{moved} of {len(history)} steps updated the weights (gradient norm > 0); mean reward "
              f"{min(h['reward/mean'] for h in history):.2f}-{max(h['reward/mean'] for h in history):.2f}")
    return status


if __name__ == "__main__":
    sys.exit(main())
