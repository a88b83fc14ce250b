"""One process of tests/test_compile_cache.py: greedy answers of vLLM (SmolLM2-135M-Instruct, fp32) to the main
job's prompts (``configs/grpo.yaml``: the arithmetic task's first held-out problems, its prompt style).

    python tests/dist/vllm_greedy_worker.py eager|compiled N_PROMPTS MAX_TOKENS

Prints one JSON line: the response token ids per prompt, whether vLLM ran compiled, and its ``compile_note``.
"""

from __future__ import annotations

import json
import os
import sys

from alignment.data.prompts import build_prompt_ids
from alignment.data.tasks import load_problems
from alignment.models.hf_assets import prepare_hf_dir
from alignment.data.samples import SamplingConfig
from alignment.rollout.engines.vllm_engine import VLLMEngine

MAIN_JOB_TASK = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}  # configs/data/arithmetic.yaml


def main(mode: str, n: int, max_tokens: int) -> None:
    hf_dir = prepare_hf_dir("smollm2")
    engine = VLLMEngine(str(hf_dir), max_model_len=512, kv_cache_gib=0.25, dtype="float32",
                        enforce_eager=mode == "eager")
    problems = load_problems("arithmetic", "heldout", n, generator_kwargs=MAIN_JOB_TASK)
    prompts = [build_prompt_ids(engine.tokenizer, p) for p in problems]
    out = engine.generate(prompts, SamplingConfig(n=1, temperature=0.0, max_tokens=max_tokens))
    print("RESULT " + json.dumps({"tokens": [s[0].response_ids for s in out], "compiled": engine.compiled,
                                  "note": engine.compile_note}), flush=True)
    os._exit(0)  # vLLM's in-process engine can hang at interpreter exit


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
