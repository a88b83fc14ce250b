"""``math_verify`` against the task's number extractor on the policy's own GSM8K answers: how often
the two graders agree, and each kind of case where they differ, with examples.

    python bench/grader_agreement.py [--problems 200] [--samples 4] [--max-tokens 256] [--dtype bfloat16]

SmolLM2-135M-Instruct (vLLM, in this process) answers GSM8K's held-out problems with the task's
prompt ("Answer with a single number.") at temperature 0.7; every answer is graded by
:func:`alignment.data.tasks.score_response` (the final number: the last ``\\boxed{}``, else "answer
is X", else the last number; numeric equality) and by the ``math_verify`` grader
(:func:`alignment.rewards.graders.math_verify`, Hugging Face's ``math-verify``). The table gives
the agreement rate and the counts of each disagreement kind; the JSON holds every disagreement.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import time
from collections import Counter

from alignment.data.prompts import build_prompt_ids
from alignment.data.tasks import load_problems, score_response
from alignment.models.hf_assets import prepare_hf_dir
from alignment.rewards.graders import math_verify
from alignment.data.samples import SamplingConfig
from alignment.rollout.engines.vllm_engine import VLLMEngine


def kind(text: str, extractor: float, verifier: float) -> str:
    """A short name for why the two graders differ on ``text``."""
    who = "extractor only" if extractor > verifier else "math_verify only"
    if "\\boxed" in text:
        return f"{who}: a \\boxed answer"
    if re.search(r"answer\s*(is|:)", text, re.IGNORECASE):
        return f"{who}: 'the answer is ...'"
    numbers = re.findall(r"-?\d[\d,]*(?:\.\d+)?", text)
    if len(numbers) <= 1:
        return f"{who}: one number"
    if re.search(r"\d{1,3}(?:,\d{3})+", text):
        return f"{who}: thousands commas"
    if re.search(r"\d\s*[%$]|\$\s*\d", text):
        return f"{who}: units ($, %)"
    return f"{who}: several numbers, none marked"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--problems", type=int, default=200)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--out", default="grader_agreement.json")
    ap.add_argument("--dtype", default="bfloat16", help="float32 on a CPU without AVX-512")
    args = ap.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

    import torch
    from transformers import AutoTokenizer

    torch.manual_seed(0)
    hf_dir = prepare_hf_dir("smollm2")
    tok = AutoTokenizer.from_pretrained(hf_dir)
    problems = load_problems("gsm8k", "heldout", args.problems)
    engine = VLLMEngine(str(hf_dir), max_model_len=1024, kv_cache_gib=1.0, dtype=args.dtype)
    t0 = time.perf_counter()
    groups = engine.generate([build_prompt_ids(tok, p) for p in problems],
                             SamplingConfig(n=args.samples, temperature=0.7, max_tokens=args.max_tokens))
    seconds = time.perf_counter() - t0
    pairs = [(p, s.text) for p, g in zip(problems, groups) for s in g]
    extractor = [score_response(p, t) for p, t in pairs]
    verifier = [v if v is not None else 0.0 for v in math_verify([p for p, _ in pairs], [t for _, t in pairs])]
    differ = [{"kind": kind(t, e, v), "answer": p.answer, "text": t, "extractor": e, "math_verify": v}
              for (p, t), e, v in zip(pairs, extractor, verifier) if e != v]
    n = len(pairs)
    kinds = Counter(d["kind"] for d in differ)
    print(f"GSM8K held-out: {len(problems)} problems x {args.samples} samples of SmolLM2-135M-Instruct "
          f"(T=0.7, {args.max_tokens} tokens, {args.dtype}, {seconds:.0f} s of generation)")
    print("| grader | right | rate |\n|---|---|---|")
    print(f"| number extractor (`score_response`) | {int(sum(extractor))} | {sum(extractor) / n:.3f} |")
    print(f"| `math_verify` | {int(sum(verifier))} | {sum(verifier) / n:.3f} |")
    print(f"\nagree on {n - len(differ)} of {n} answers ({(n - len(differ)) / n:.1%})\n")
    print("| where they differ | answers |\n|---|---|")
    for k, c in kinds.most_common():
        print(f"| {k} | {c} |")
    for k in kinds:
        d = next(x for x in differ if x["kind"] == k)
        print(f"\n{k}: reference {d['answer']}, response {d['text'][-160:]!r}")
    with open(args.out, "w") as f:
        json.dump({"answers": n, "extractor_right": sum(extractor), "math_verify_right": sum(verifier),
                   "agree": n - len(differ), "kinds": dict(kinds), "differ": differ}, f, indent=1)
    engine.close()


if __name__ == "__main__":
    main()
