"""Every job kind's metrics before and after a change, compared bit for bit: the proof a refactor owes.

    python scripts/job_parity.py BASE [--jobs grpo,sft] [--out DIR]

Runs 14 jobs (GRPO plain, DAPO, with a process reward, multi-turn, and on a tiny Qwen3-MoE with routing replay R2;
PPO, RFT, online DPO, distillation; SFT, reward model, DPO, KTO, PRM) for 2 steps each on a tiny random Llama on 2 CPU processes (one torchrun launch, about
a minute on 2 cores), once in a git worktree of the commit ``BASE`` and once in this working tree, and prints a
markdown table: per job, how many of its step metrics (every metric that is not a time or a size) and held-out
results are equal bit for bit. Online jobs generate with the Megatron engine; GRPO, DAPO, RFT, online DPO and
distillation are graded by the even-length reward (tests/dist/e2e_worker.py) so that a random model's rewards
vary. Exits 1 when anything differs. Not here: a job whose episodes an agent program plays, which does not
reproduce even on the same code (docs/guides/agents.md).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: what a metric's name holds when it is a time, a rate or a size (machine-dependent: never compared)
NOT_COMPARED = ("seconds", "_s", "per_s", "time", "memory", "mem", "wall", "mfu", "throughput", "gib", "/s")
#: the jobs graded by the even-length reward
EVEN_LENGTH = {"grpo", "dapo", "grpo_process", "grpo_multi_turn", "rft", "online_dpo", "distill"}


def jobs(out: Path, model: Path, teacher: Path) -> dict[str, tuple[str, list[str]]]:
    """name -> (config name, overrides). The PRM job comes first: GRPO's process reward scores with its export."""
    online = ["trainer.steps=2", "rollout.prompts_per_step=4", "rollout.group_size=4", "trainer.micro_batch_size=2",
              "data.heldout_size=4", "data.train_size=40", "rollout.max_tokens=16", "rollout.eval_max_tokens=6",
              "trainer.lr=1e-3", "trainer.progress_bar=false", "trainer.export_hf=false", "rollout.backend=megatron",
              "trainer.save_checkpoint=false"]
    offline = ["data.max_length=64", "data.max_prompt_length=32", "trainer.progress_bar=false", "trainer.lr=1e-3",
               "data.train_size=8", "data.heldout_size=8", "trainer.global_batch_size=8", "trainer.micro_batch_size=2",
               "trainer.epochs=2"]
    one_sample = [o for o in online if "micro_batch" not in o] + ["trainer.micro_batch_size=1"]
    return {
        "prm": ("prm", [o for o in offline if not o.startswith(("data.max_prompt", "data.max_length"))]
                + [f"data.dataset={out / 'prm_data'}", "data.max_length=160", "trainer.lr=1e-4"]),
        "grpo": ("grpo", online),
        "dapo": ("dapo", online),
        "grpo_process": ("grpo", online + [f"reward.process_reward_model={out / 'prm' / 'hf'}",
                                           "reward.functions=[{name: correctness}, {name: process_reward, weight: 0.5}]"]),
        "grpo_multi_turn": ("grpo", online + [
            "data.task=arithmetic", "rollout.environment=tests.dist.echo_env:build", "rollout.max_turns=3",
            "rollout.max_tokens=32", "rollout.max_tokens_per_turn=6",
            "reward.functions=[{name: correctness}, {name: environment, weight: 0.5}]"]),
        "grpo_moe_r2": ("grpo", online + ["data.task=length", "algorithm.routing_replay=r2",
                                          "algorithm.num_mini_batches=2", "model.moe_aux_loss_coeff=0.01"]),
        "ppo": ("ppo", [o for o in one_sample if not o.startswith(("rollout.group_size", "rollout.eval_max"))] + [
            f"model.reward_model_path={model}", "algorithm.num_mini_batches=2", "algorithm.ppo_epochs=2",
            "trainer.critic_lr=1e-3", "reward.functions=[{name: reward_model}, {name: length, weight: 0.1}]"]),
        "rft": ("rft", online),
        "online_dpo": ("online_dpo", one_sample),
        "distill": ("distill", online + [f"model.teacher_path={teacher}"]),
        "sft": ("sft", offline + ["trainer.export_hf=false"]),
        "rm": ("rm", offline + ["trainer.export_hf=false"]),
        "dpo": ("dpo", offline + ["trainer.export_hf=false", "algorithm.beta=0.5"]),
        "kto": ("dpo", offline + ["trainer.export_hf=false", "algorithm.loss_type=kto"]),
    }


def run(tree: Path, out: Path, only: list[str] | None) -> None:
    """The jobs in ``tree`` (its own code, tests and configs), summaries to ``out/<job>.json``."""
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1", "MEGALIGN_CACHE": str(out / "cache")}
    prepare = ("import sys; from pathlib import Path; out = Path(sys.argv[1]);"
               "from tests.dist.tiny_llama import save_tiny_hf_dir; from tests.test_prm_e2e import write_data;"
               "save_tiny_hf_dir(out / 'tiny'); save_tiny_hf_dir(out / 'teacher', seed=7); write_data(out / 'prm_data');"
               "from tests.dist.tiny_models import save_tiny_dir; save_tiny_dir(out / 'moe', 'qwen3_moe')")
    subprocess.run([sys.executable, "-c", prepare, str(out)], cwd=tree, env=env, check=True)
    spec = [{"config": config, "model": str(out / ("moe" if "moe" in name else "tiny")), "out": str(out / name), "overrides": overrides,
             "result": str(out / f"{name}.json"), "reward": "even_length" if name in EVEN_LENGTH else "task", "env": {}}
            for name, (config, overrides) in jobs(out, out / "tiny", out / "teacher").items()
            if only is None or name in only or name == "prm"]
    (out / "jobs.json").write_text(json.dumps(spec, indent=1))
    with open(out / "log.txt", "w") as log:
        rc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                             str(tree / "tests" / "dist" / "jobs_worker.py"), str(out / "jobs.json")],
                            cwd=tree, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
    if rc:
        sys.exit(f"the jobs failed in {tree} (exit {rc}): see {out / 'log.txt'}")


def compare(before: Path, after: Path) -> tuple[str, bool]:
    """The table, and whether every job's compared values are equal."""
    rows = ["| job | metrics compared | equal bit for bit | loss, steps 1 and 2 | grad_norm, steps 1 and 2 |",
            "|---|---|---|---|---|"]
    equal = True
    for path in sorted(after.glob("*.json")):
        if path.name == "jobs.json":
            continue
        x, y = json.loads((before / path.name).read_text()), json.loads(path.read_text())
        keys = sorted({k for h in x["history"] + y["history"] for k in h if not any(t in k for t in NOT_COMPARED)})
        differ = [k for k in keys if len(x["history"]) != len(y["history"])
                  or any(p.get(k) != q.get(k) for p, q in zip(x["history"], y["history"]))]
        heldout = [k for k in {**x, **y} if k.startswith("heldout") and k != "heldout_before_overlapped"]
        differ += [f"summary.{k}" for k in heldout if x.get(k) != y.get(k)]
        equal &= not differ
        loss = next(k for k in ("loss", "loss/policy", "dpo/loss", "loss/sft") if k in y["history"][-1])
        values = lambda key: ", ".join(f"{h.get(key, float('nan')):.6g}" for h in y["history"])  # noqa: E731
        rows.append(f"| {path.stem} | {len(keys) + len(heldout)} | {'all' if not differ else 'NOT ' + ', '.join(differ)}"
                    f" | {loss}: {values(loss)} | {values('grad_norm')} |")
    return "\n".join(rows), equal


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("base", help="the commit to compare this working tree with")
    parser.add_argument("--jobs", help="comma-separated job names (default: all)")
    parser.add_argument("--out", type=Path, help="where the runs go (default: a new temporary folder)")
    args = parser.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="job_parity_"))
    only = args.jobs.split(",") if args.jobs else None
    worktree = out / "base_tree"
    subprocess.run(["git", "worktree", "add", "--detach", "-f", str(worktree), args.base], cwd=ROOT, check=True,
                   capture_output=True)
    try:
        run(worktree, out / "before", only)
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(worktree)], cwd=ROOT, check=False)
    run(ROOT, out / "after", only)
    table, equal = compare(out / "before", out / "after")
    print(f"{args.base} -> this working tree ({out}):\n{table}")
    sys.exit(0 if equal else 1)


if __name__ == "__main__":
    main()
