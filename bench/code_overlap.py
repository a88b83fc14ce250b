"""Code scoring overlapped with generation: SmolLM2-135M in the in-process vLLM engine answers
HumanEval held-out problems (``--n`` samples each), and every answer's unit tests run in the sandbox
(:func:`alignment.rewards.code_runs.program`, a pool of :func:`alignment.sandbox.runner.sandbox_workers`).

- **after**: generate everything, then grade (what the trainers did before ``on_done``);
- **overlapped**: each prompt's programs start in the pool as soon as vLLM finishes its samples
  (:func:`alignment.rewards.code_runs.prefetcher` as the engine's ``on_done``); after the generation
  the grader only waits for the runs still going.

Both modes sample the same answers (the engine is reseeded with the same step) and must grade them
alike. Measured side by side in one run, alternating, ``--repeats`` times each. The figure:
the share of the scoring time that the overlap hides, ``1 - (overlapped wait after generation) /
(scoring after)``, and the whole rollout's speed-up.

    python bench/code_overlap.py [--problems 20] [--n 4] [--max-tokens 256] [--repeats 2]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from alignment.algorithms.composite_reward import RewardTerm  # noqa: E402
from alignment.data.code_tasks import CODE_LIMITS  # noqa: E402
from alignment.data.prompts import build_prompt_ids  # noqa: E402
from alignment.data.tasks import load_problems  # noqa: E402
from alignment.models.hf_assets import prepare_hf_dir  # noqa: E402
from alignment.rewards.code_runs import code_pool, prefetcher  # noqa: E402
from alignment.rewards.functions import function_scores  # noqa: E402
from alignment.data.samples import SamplingConfig  # noqa: E402

CORRECTNESS = RewardTerm("correctness")


def rollout(engine, problems, prompts, sampling: SamplingConfig, overlap: bool) -> dict:
    """One rollout of ``prompts`` graded with ``correctness``: seconds generating and grading after
    it, the scores, and how many runs the grader found started."""
    engine.reseed(0)  # the same answers in both modes
    engine.llm.reset_prefix_cache()  # and no prompt KV left by the run before
    flat = [p for p in problems for _ in range(sampling.n)]
    with code_pool() as pool:
        t0 = time.perf_counter()
        groups = engine.generate(prompts, sampling, prefetcher(pool, [CORRECTNESS.runs], problems) if overlap else None)
        t1 = time.perf_counter()
        scores = function_scores(CORRECTNESS, flat, [s for g in groups for s in g], sampling.max_tokens, pool=pool)
        t2 = time.perf_counter()
        return {"generate": t1 - t0, "grade": t2 - t1, "total": t2 - t0, "scores": scores.tolist(),
                "taken": pool.taken, "runs": pool.asked, "tokens": sum(len(s.response_ids) for g in groups for s in g)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--problems", type=int, default=20)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args(argv)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from alignment.rollout.engines.vllm_engine import VLLMEngine

    engine = VLLMEngine(str(prepare_hf_dir("smollm2")), max_model_len=1024, kv_cache_gib=1.0, seed=0)
    problems = load_problems("humaneval", "heldout", args.problems)
    prompts = [build_prompt_ids(engine.tokenizer, p) for p in problems]
    sampling = SamplingConfig(n=args.n, temperature=1.0, max_tokens=args.max_tokens)
    engine.generate(prompts[:2], SamplingConfig(n=1, max_tokens=8))  # warm-up
    runs = {False: [], True: []}
    for _ in range(args.repeats):
        for overlap in (False, True):
            runs[overlap].append(rollout(engine, problems, prompts, sampling, overlap))
    engine.close()
    after, over = runs[False], runs[True]
    if any(r["scores"] != after[0]["scores"] for r in after + over):
        print("error: the two modes graded the answers differently")
        return 1

    def mean(rs, k):
        return sum(r[k] for r in rs) / len(rs)

    hidden = 1 - mean(over, "grade") / mean(after, "grade")
    print(f"{args.problems} HumanEval held-out problems x {args.n} samples, max_tokens {args.max_tokens}, "
          f"{after[0]['tokens']} tokens, {after[0]['runs']} programs ({sum(after[0]['scores']):.0f} pass), "
          f"{CODE_LIMITS.wall_seconds:.0f} s wall limit each; {os.cpu_count()} cores")
    rows = ["| mode | generate (s) | grade after generation (s) | rollout (s) | runs started early |",
            "|---|---|---|---|---|"]
    for name, rs in (("after", after), ("overlapped", over)):
        rows.append(f"| {name} | {mean(rs, 'generate'):.2f} | {mean(rs, 'grade'):.2f} | {mean(rs, 'total'):.2f} | "
                    f"{mean(rs, 'taken'):.0f} / {mean(rs, 'runs'):.0f} |")
    print("\n".join(rows))
    print(f"scoring hidden by the overlap: {hidden:.0%}; rollout {mean(after, 'total') / mean(over, 'total'):.2f}x "
          f"faster (per repeat: after {[round(r['total'], 1) for r in after]}, "
          f"overlapped {[round(r['total'], 1) for r in over]})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
