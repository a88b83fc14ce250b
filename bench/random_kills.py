"""Kills at random wall-clock times, not at hooks: a GRPO job (2 ranks, the in-process vLLM engine,
a tiny random Llama whose checkpoint with its Adam state is ~45 MB, one every step) is SIGKILLed
whole (torchrun, both ranks, every helper process, at once, as when a node loses power) at a time
drawn uniformly from ``[0, --window]`` seconds after the run began training, ``--trials`` times in a
row on one run directory; each launch resumes what the last one left. A last launch finishes the
job. Then every step any launch logged, the held-out accuracy and the final weights' bytes must
equal the uninterrupted run's, bit for bit.

    python bench/random_kills.py [--trials 20] [--steps 40] [--window 6] [--seed 0] [--out outputs/random_kills]

Prints the trial log (when each kill came, the phase each rank was in, whether it landed inside a
checkpoint save: a ``step_N.tmp`` left unpublished, which the next launch ignores) and the verdict;
exits 1 when a resumed run differs. The job is ``tests/dist/kill_worker.py`` with no kill of its
own (it logs every step's metrics at full precision to ``<out>/steps.jsonl``).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.soak import tiny_model  # noqa: E402
from launchers.phase_log import read_phases  # noqa: E402

WORKER = ROOT / "tests" / "dist" / "kill_worker.py"
JOB = ["trainer.save_every=1", "rollout.prompts_per_step=2", "rollout.group_size=4", "trainer.micro_batch_size=2",
       "data.heldout_size=4", "data.train_size=200", "rollout.max_tokens=16", "rollout.eval_max_tokens=8",
       "trainer.lr=1e-3", "trainer.progress_bar=false", "rollout.kv_cache_gib=0.25"]
#: metrics of the machine, not of the run
UNTIMED = ("time/", "tokens_per_s", "memory/", "weight_sync/", "seconds")


def launch(model: Path, out: Path, result: Path, steps: int, log: Path) -> subprocess.Popen:
    """Start the job (torchrun, 2 ranks of ``tests/dist/kill_worker.py`` with no kill of its own) on
    ``model`` into ``out`` for ``steps`` steps, its output to ``log``, in a session of its own."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(WORKER),
           str(model), str(out), "none", "0", f"trainer.steps={steps}", *JOB, str(result)]
    with open(log, "w") as f:  # a file, not a pipe: nothing the kill leaves may hold it open
        return subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"},
                                stdout=f, stderr=subprocess.STDOUT, start_new_session=True)


def kill_whole_job(proc: subprocess.Popen) -> int:
    """SIGKILL torchrun and every process under it at once; wait until all are gone. How many died."""
    try:
        family = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        family = []
    for p in family:
        try:
            p.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    proc.wait()
    psutil.wait_procs(family, timeout=30)
    return len(family)


def training_began(out: Path, since: float) -> bool:
    """Some rank of the launch made at ``since`` (``time.time()``) is past its start-up (the last
    launch's records stay until this one replaces them)."""
    return any(r.get("since", 0) >= since and r.get("phase") not in (None, "start-up", "evaluation")
               for r in read_phases(out).values())


def trial(model: Path, out: Path, result: Path, steps: int, log: Path, delay: float) -> dict:
    """One launch, SIGKILLed ``delay`` s after it began training (or left to finish first)."""
    t0, wall = time.monotonic(), time.time()
    proc = launch(model, out, result, steps, log)
    while proc.poll() is None and not training_began(out, wall) and time.monotonic() - t0 < 600:
        time.sleep(0.05)
    began = time.monotonic()
    while proc.poll() is None and time.monotonic() - began < delay:
        time.sleep(0.01)
    if proc.poll() is not None:
        return {"killed": False, "exit": proc.returncode, "seconds": time.monotonic() - t0}
    records = read_phases(out)
    procs = kill_whole_job(proc)
    saving = {rec.get("step") for rec in records.values() if rec.get("phase") == "checkpoint"}
    unpublished = [f"step_{n}.tmp" for n in sorted(saving) if (out / "checkpoints" / f"step_{n}.tmp").is_dir()]
    return {"killed": True, "after_s": delay, "phases": {r: f"{rec.get('phase')} {rec.get('step')}"
                                                          for r, rec in sorted(records.items())},
            "processes": procs, "in_save": bool(unpublished), "unpublished": unpublished,
            "seconds": time.monotonic() - t0}


def untimed(record: dict) -> dict:
    """A step's metrics without those of the machine (:data:`UNTIMED`: times, throughput, memory)."""
    return {k: v for k, v in record.items() if not any(u in k for u in UNTIMED)}


def compare(base: Path, base_result: Path, run: Path, result: Path) -> list[str]:
    """What differs between the chain of resumed runs and the uninterrupted one (empty: nothing)."""
    expected = {r["step"]: untimed(r) for r in map(json.loads, (base / "steps.jsonl").read_text().splitlines())}
    problems = []
    for line in (run / "steps.jsonl").read_text().splitlines():
        record = json.loads(line)
        if untimed(record) != expected.get(record["step"]):
            problems.append(f"step {record['step']}'s metrics differ")
    logged = {json.loads(line)["step"] for line in (run / "steps.jsonl").read_text().splitlines()}
    if logged != set(expected):
        problems.append(f"steps logged {sorted(logged)} != {sorted(expected)}")
    a, b = json.loads(base_result.read_text()), json.loads(result.read_text())
    if a["heldout_accuracy_after"] != b["heldout_accuracy_after"]:
        problems.append(f"held-out accuracy {b['heldout_accuracy_after']} != {a['heldout_accuracy_after']}")
    if (base / "hf" / "model.safetensors").read_bytes() != (run / "hf" / "model.safetensors").read_bytes():
        problems.append("the final weights' bytes differ")
    return problems


def kill_trials(out: Path, trials: int, steps: int, window: float, seed: int) -> tuple[list[dict], list[str]]:
    """Run the uninterrupted job, then ``trials`` killed launches and a last one on one directory;
    returns the trial records (the last launch's included) and what differs (empty: nothing)."""
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    model = tiny_model(out / "tiny")
    base, run = out / "base", out / "run"
    proc = launch(model, base, out / "base.json", steps, out / "base.log")
    if proc.wait() != 0:
        raise RuntimeError(f"the uninterrupted run failed: see {out / 'base.log'}")
    rng = random.Random(seed)
    records, texts = [], []
    for i in range(trials):
        log = out / f"trial{i + 1}.log"
        records.append(trial(model, run, out / "run.json", steps, log, rng.uniform(0, window)))
        texts.append(log.read_text(errors="replace"))
        if not records[-1]["killed"]:
            break
    if records[-1]["killed"]:
        proc = launch(model, run, out / "run.json", steps, out / "final.log")
        records.append({"killed": False, "exit": proc.wait()})
        texts.append((out / "final.log").read_text(errors="replace"))
    problems = []
    for rec, text in zip(records, texts):
        rec["resumed_from"] = resumed_from(text)
    for rec, following in zip(records, texts[1:]):  # an unpublished save is ignored, never read
        for name in rec.get("unpublished", []):
            if f"ignoring {name}" not in following:
                problems.append(f"the launch after {name} was left did not say it ignored it")
    if records[-1].get("exit") != 0:
        return records, problems + [f"the last launch failed (exit {records[-1].get('exit')})"]
    return records, problems + compare(base, out / "base.json", run, out / "run.json")


def resumed_from(text: str) -> int:
    """The step a launch's output says it resumed from (0: it started afresh)."""
    found = re.findall(r"resumed from \S+ \(step (\d+)\)", text)
    return int(found[-1]) if found else 0


def table(records: list[dict]) -> str:
    """The trial log as a Markdown table, one row per launch."""
    lines = ["| launch | resumed from step | killed after training began (s) | rank 0 | rank 1 | inside a save | "
             "processes killed |", "|---|---|---|---|---|---|---|"]
    for i, r in enumerate(records):
        if r["killed"]:
            save = f"yes ({', '.join(r['unpublished'])} left, ignored by the next launch)" if r["in_save"] else "no"
            lines.append(f"| {i + 1} | {r['resumed_from']} | {r['after_s']:.2f} | {r['phases'].get(0, '-')} | "
                         f"{r['phases'].get(1, '-')} | {save} | {r['processes']} |")
        else:
            lines.append(f"| {i + 1} | {r['resumed_from']} | finished (exit {r['exit']}) | | | | |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--window", type=float, default=6.0, help="kill within this many s of a launch's training start")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=ROOT / "outputs" / "random_kills")
    args = ap.parse_args(argv)
    t = time.time()
    records, problems = kill_trials(args.out, args.trials, args.steps, args.window, args.seed)
    kills = [r for r in records if r["killed"]]
    print(table(records))
    print(f"\n{len(kills)} kills, {sum(r['in_save'] for r in kills)} inside a save; "
          f"{time.time() - t:.0f} s in all")
    print("every resumed run equals the uninterrupted run (metrics of every step, held-out accuracy, final weights' "
          "bytes)" if not problems else "DIFFERS: " + "; ".join(problems))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
