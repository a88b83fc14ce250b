"""Profile a job: run it with ``profile.enabled=true`` under torchrun and print its report, or
report on a finished run.

    python tools/profile_step.py --nproc 2 --steps 2 --ranks 0 1 -- --config-name sft trainer.steps=3
    python tools/profile_step.py --report outputs/sft_smollm2_alpaca

The report: a per-phase timer table (rollout, weight sync, reference/old logprobs, training,
checkpoint; seconds per step, mean over the steps after the first, which warms up), tokens/s,
an MFU estimate of the training phase (:mod:`alignment.models.flops`, against a matmul peak
measured here: per GPU times GPUs, or per CPU host), peak memory per rank (RSS; CUDA
allocated/reserved on GPU), and the ``torch.profiler`` traces written (Chrome/TensorBoard
JSON; on GPU also CUDA memory snapshots).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from alignment.algorithms import registry  # noqa: E402
from alignment.models.families import model_dims  # noqa: E402
from alignment.models.flops import flops_per_token, measured_matmul_peak  # noqa: E402
from alignment.models.hf_assets import prepare_hf_dir  # noqa: E402
from launchers.preflight import compose  # noqa: E402

PHASES = ["rollout", "weight_sync", "logprobs", "train"]  # time/<phase> in the step metrics


def _steady(history: list[dict]) -> list[dict]:
    """The steps after the first (which compiles, allocates and warms caches), or the only one."""
    return history[1:] if len(history) > 1 else history


def _mean(rows: list[dict], key: str) -> float | None:
    values = [r[key] for r in rows if key in r]
    return sum(values) / len(values) if values else None


def mfu(summary: dict, cfg, hf_config, peak_flops: float) -> dict | None:
    """Training-phase MFU: tokens trained per step x training FLOPs per token (x ``ppo_epochs``
    for the RL jobs) / ``time/train`` / ``peak_flops`` (FLOP/s of all devices together).
    ``None`` when the run logged no token counts (PPO). Forward-only passes (rollout, old and
    reference logprobs, DPO's reference) are not counted. The output layer counts on response
    tokens only where the run logs ``response_length`` (the RL jobs, whose losses compute logits
    there alone), else on every token (an upper bound for SFT/DPO, which also skip prompts)."""

    rows = _steady(summary["history"])
    seq, train_s = _mean(rows, "seq_length"), _mean(rows, "time/train")
    # each step's own tokens (its rate x its time): the mean rate x the mean time overstates them when step
    # times vary (the mean of T / s_i times the mean of s_i is >= T)
    counted = [r["tokens_per_s"] * r["time/step"] for r in rows if "tokens_per_s" in r and "time/step" in r]
    if not counted or seq is None or not train_s:
        return None
    tokens = sum(counted) / len(counted)  # tokens per step
    passes = 1 if not registry.get(cfg.algorithm.name).online else cfg.algorithm.get("ppo_epochs", 1)
    response = _mean(rows, "response_length")
    out_fraction = min(1.0, response / seq) if response is not None else 1.0
    flops = tokens * passes * flops_per_token(model_dims(hf_config), seq, output_fraction=out_fraction)
    return {"tokens_per_step": tokens, "train_flops_per_step": flops, "achieved_flops": flops / train_s,
            "peak_flops": peak_flops, "mfu": flops / train_s / peak_flops}


def device_peak(summary: dict, dtype_name: str) -> tuple[float, str]:
    """(FLOP/s of all devices of the run, description): a matmul measured now on this machine's
    GPU times the run's GPUs, or on this CPU host (all cores) times the run's hosts."""
    import torch

    dtype = getattr(torch, dtype_name)
    if torch.cuda.is_available():
        per = measured_matmul_peak("cuda", dtype, n=8192)
        n = len(summary["memory"])
        return per * n, f"{n} GPU x {per / 1e12:.1f} TFLOP/s ({dtype_name} 8192^3 matmul, measured)"
    torch.set_num_threads(os.cpu_count() or 1)
    per = measured_matmul_peak("cpu", dtype, n=2048)
    hosts = len({m["host"] for m in summary["memory"]})
    return per * hosts, f"{hosts} CPU host x {per / 1e9:.1f} GFLOP/s ({dtype_name} 2048^3 matmul, {os.cpu_count()} cores)"


def report(out_dir: str | os.PathLike, peak: tuple[float, str] | None = None) -> tuple[str, dict]:
    """The report of the finished run in ``out_dir`` (``summary.json`` + ``config.yaml``) as
    text, and its numbers as a dict. ``peak``: (FLOP/s, description), measured if ``None``.

    Raises:
        FileNotFoundError: ``out_dir`` holds no ``summary.json`` (the run did not finish).
    """
    from omegaconf import OmegaConf
    from transformers import AutoConfig

    out = Path(out_dir)
    if not (out / "summary.json").exists():
        raise FileNotFoundError(f"{out}/summary.json not found: not a finished megalign run directory")
    summary = json.loads((out / "summary.json").read_text())
    cfg = OmegaConf.load(out / "config.yaml")
    rows = _steady(summary["history"])
    step_s = _mean(rows, "time/step")
    lines = [f"# Profile of {out} ({cfg.algorithm.name}, world {summary['world_size']}, "
             f"{len(rows)} of {len(summary['history'])} steps averaged)", "",
             "| phase | s/step | % of step |", "|---|---|---|"]
    numbers = {"phases": {}}
    for phase in PHASES:
        s = _mean(rows, f"time/{phase}")
        if s is not None:
            numbers["phases"][phase] = s
            lines.append(f"| {phase} | {s:.3f} | {100 * s / step_s:.1f} |")
    ck = summary.get("phase_timers", {}).get("checkpoint")
    if ck:
        numbers["phases"]["checkpoint"] = ck["seconds"] / ck["count"]
        lines.append(f"| checkpoint (per save, {ck['count']} saves) | {ck['seconds'] / ck['count']:.3f} | - |")
    lines.append(f"| **step** | {step_s:.3f} | 100 |")
    numbers["step"] = step_s
    tps = _mean(rows, "tokens_per_s")
    lines.append("")
    if tps is not None:
        numbers["tokens_per_s"] = tps
        lines.append(f"tokens/s: {tps:,.0f} (all ranks)")
    hf_config = AutoConfig.from_pretrained(prepare_hf_dir(cfg.model.path))
    peak = peak or device_peak(summary, cfg.model.dtype)
    m = mfu(summary, cfg, hf_config, peak[0])
    if m is not None:
        numbers["mfu"] = m
        lines.append(f"MFU (training phase): {100 * m['mfu']:.2f} % = {m['achieved_flops'] / 1e9:,.1f} GFLOP/s "
                     f"achieved / {peak[1]}")
    lines += ["", "| rank | host | peak RSS GiB | CUDA max allocated GiB | CUDA max reserved GiB |", "|---|---|---|---|---|"]
    for r in summary["memory"]:
        cuda = [f"{r[k]:.2f}" if k in r else "-" for k in ("cuda_max_allocated_gib", "cuda_max_reserved_gib")]
        lines.append(f"| {r['rank']} | {r['host']} | {r['peak_rss_gib']:.2f} | {cuda[0]} | {cuda[1]} |")
    numbers["memory"] = summary["memory"]
    traces = [t for r in summary["memory"] for t in r.get("traces", [])]
    numbers["traces"] = traces
    lines += ["", "traces:" if traces else "traces: none (profile.enabled was false)"] + [f"  {t}" for t in traces]
    return "\n".join(lines), numbers


def _output_dir(hydra_args: list[str]) -> Path:
    """The resolved ``output_dir`` of the job these Hydra arguments compose."""

    name, overrides, args = "grpo", [], list(hydra_args)
    while args:
        a = args.pop(0)
        if a.startswith("--config-name"):
            name = a.split("=", 1)[1] if "=" in a else args.pop(0)
        elif not a.startswith("-"):
            overrides.append(a)
    return Path(compose(name, overrides).output_dir)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=1, help="processes (torchrun --nproc-per-node)")
    p.add_argument("--steps", type=int, nargs="+", default=[2], help="1-based optimizer steps to trace")
    p.add_argument("--ranks", type=int, nargs="+", default=[0], help="global ranks that trace")
    p.add_argument("--report", metavar="OUTPUT_DIR", help="only print the report of a finished run")
    p.add_argument("--json", metavar="PATH", help="also write the report's numbers as JSON")
    p.add_argument("hydra_args", nargs="*", help="after --: --config-name NAME and overrides, as for launchers/train.py")
    a = p.parse_args(argv)
    if a.report:
        out = Path(a.report)
    else:
        if min(a.steps) < 1:
            p.error(f"--steps {a.steps}: steps are 1-based optimizer steps")
        if min(a.ranks) < 0 or max(a.ranks) >= a.nproc:
            p.error(f"--ranks {a.ranks}: must be in [0, --nproc={a.nproc})")
        out = _output_dir(a.hydra_args)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(a.nproc),
               str(ROOT / "launchers" / "train.py"), *a.hydra_args, "profile.enabled=true",
               f"profile.steps=[{','.join(map(str, a.steps))}]", f"profile.ranks=[{','.join(map(str, a.ranks))}]"]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
        proc = subprocess.run(cmd, env=env)
        if proc.returncode:
            print(f"the job failed (exit {proc.returncode})", file=sys.stderr)
            return proc.returncode
    text, numbers = report(out)
    print(text)
    if a.json:
        Path(a.json).write_text(json.dumps(numbers, indent=1, default=float))
    return 0


if __name__ == "__main__":
    sys.exit(main())
