"""Step-labelled solutions for the process reward model (``--config-name prm``), sampled from the
policy with vLLM and labelled without humans: each line of a solution is checked by evaluating
its arithmetic (:func:`alignment.data.step_labels.arithmetic_step_label`), as Math-Shepherd labels
steps automatically (Wang et al. 2024) but from the step itself.

    python tools/make_prm_data.py --out outputs/prm_data                  # SmolLM2, 3-4-term sums
    python tools/make_prm_data.py --model path/to/hf_dir --train-problems 50 --samples 4 --out DIR

Problems are reasoning-gym ``chain_sum`` sums (``--min-terms`` .. ``--max-terms`` terms of
``--min-digits`` .. ``--max-digits`` digits), the train and held-out questions disjoint (the
arithmetic task's hash split), asked with :data:`alignment.data.step_data.STEP_INSTRUCTION`.
``--samples`` solutions per problem at ``--temperature``. Writes ``<out>/train.jsonl`` and
``<out>/heldout.jsonl`` (TRL's stepwise-supervision fields ``prompt`` / ``completions`` /
``labels``, plus ``question``, ``answer`` and ``outcome``: the final answer graded by the task)
and ``<out>/meta.json`` (the settings and per-split counts). The held-out file keeps every
problem's solutions together, in order: ``tools/rerank.py`` picks one of them per problem.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository root

from alignment.data.chat_data import encode_prompt  # noqa: E402
from alignment.data.step_data import StepRecord, label_steps, split_steps, step_prompt, write_records  # noqa: E402
from alignment.data.tasks import load_problems, score_response  # noqa: E402
from alignment.models.hf_assets import prepare_hf_dir  # noqa: E402
from alignment.data.samples import SamplingConfig  # noqa: E402
from alignment.rollout.engines.vllm_engine import VLLMEngine  # noqa: E402


def label_solution(problem, response: str, separator: str = "\n"):
    """The :class:`alignment.data.step_data.StepRecord` of one sampled ``response`` to ``problem``:
    its steps, their automatic labels and the graded final answer."""

    steps = split_steps(response, separator)
    return StepRecord(prompt=step_prompt(problem.question), completions=steps,
                      labels=label_steps(steps), question=problem.question, answer=problem.answer,
                      outcome=score_response(problem, response) == 1.0)


def split_stats(records, samples: int) -> dict:
    """Counts of one split: solutions, steps, labelled and correct steps, outcome accuracy, and the
    fraction of problems with at least one right answer among their ``samples`` (pass@samples)."""
    labels = [y for r in records for y in r.labels]
    labelled = [y for y in labels if y is not None]
    groups = [records[i : i + samples] for i in range(0, len(records), samples)]
    return {"problems": len(groups), "solutions": len(records), "steps": len(labels), "labelled_steps": len(labelled),
            "correct_step_fraction": sum(labelled) / max(len(labelled), 1),
            "solutions_with_labels": sum(any(y is not None for y in r.labels) for r in records),
            "outcome_accuracy": sum(r.outcome for r in records) / max(len(records), 1),
            f"pass@{samples}": sum(any(r.outcome for r in g) for g in groups) / max(len(groups), 1)}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2", help="the policy: an HF directory, a .gguf, or smollm2")
    p.add_argument("--out", default="outputs/prm_data")
    p.add_argument("--train-problems", type=int, default=400)
    p.add_argument("--heldout-problems", type=int, default=100)
    p.add_argument("--samples", type=int, default=8, help="solutions per problem")
    p.add_argument("--min-terms", type=int, default=3)
    p.add_argument("--max-terms", type=int, default=4)
    p.add_argument("--min-digits", type=int, default=1)
    p.add_argument("--max-digits", type=int, default=1)
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--separator", default="\n")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--kv-cache-gib", type=float, default=0.5)
    args = p.parse_args(argv)
    for name in ("train_problems", "heldout_problems", "samples", "max_tokens", "min_terms", "min_digits"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')}={getattr(args, name)}: must be >= 1")
    if args.max_terms < args.min_terms or args.max_digits < args.min_digits:
        p.error("--max-terms / --max-digits must be >= --min-terms / --min-digits")

    kwargs = {"min_terms": args.min_terms, "max_terms": args.max_terms, "min_digits": args.min_digits,
              "max_digits": args.max_digits}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    hf_dir = str(prepare_hf_dir(args.model))
    engine = VLLMEngine(hf_dir, max_model_len=512, kv_cache_gib=args.kv_cache_gib, seed=args.seed, dtype=args.dtype)
    sampling = SamplingConfig(n=args.samples, temperature=args.temperature, max_tokens=args.max_tokens)
    meta = {"model": args.model, "generator": "chain_sum", "generator_kwargs": kwargs,
            "samples": args.samples, "temperature": args.temperature, "max_tokens": args.max_tokens,
            "separator": args.separator, "seed": args.seed, "splits": {}}
    for split, size in (("train", args.train_problems), ("heldout", args.heldout_problems)):
        t0 = time.perf_counter()
        problems = load_problems("arithmetic", split, size, args.seed, generator="chain_sum", generator_kwargs=kwargs)
        records = []
        for start in range(0, len(problems), 32):  # 32 prompts x samples per engine call
            chunk = problems[start : start + 32]
            prompts = [encode_prompt(engine.tokenizer, [{"role": "user", "content": step_prompt(q.question)}])
                       for q in chunk]
            for problem, samples in zip(chunk, engine.generate(prompts, sampling)):
                records += [label_solution(problem, s.text, args.separator) for s in samples]
        write_records(out / f"{split}.jsonl", records)
        meta["splits"][split] = split_stats(records, args.samples) | {"seconds": round(time.perf_counter() - t0, 1)}
        print(f"{split}: {json.dumps(meta['splits'][split])}", flush=True)
    (out / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    engine.close()
    return meta


if __name__ == "__main__":
    main()
