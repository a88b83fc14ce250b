"""Worker: new weights go into a running vLLM engine in memory and its logprobs then
equal transformers' on those weights, for tied and untied embeddings.

    python tests/dist/vllm_sync_worker.py WORKDIR RESULT.json
"""

from __future__ import annotations

import json
import sys

import torch


def check(workdir: str, tie: bool) -> float:
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM
    from vllm import SamplingParams

    from alignment.rollout.vllm_engine import VLLMEngine
    from tests.dist.tiny_llama import save_tiny_hf_dir

    d = f"{workdir}/tiny_{'tied' if tie else 'untied'}"
    save_tiny_hf_dir(d, tie_word_embeddings=tie)
    engine = VLLMEngine(d, max_model_len=128)
    torch.manual_seed(0)
    new = {k: v + 0.05 * torch.randn_like(v) for k, v in load_file(f"{d}/model.safetensors").items()}
    engine.update_weights(new.items())
    hf = AutoModelForCausalLM.from_pretrained(d).eval()
    hf.load_state_dict(new, strict=False)
    ids = [1, 50, 300, 7000, 12, 99, 4000, 5]
    out = engine.llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1, prompt_logprobs=0),
                              use_tqdm=False)[0]
    got = torch.tensor([step[t].logprob for step, t in zip(out.prompt_logprobs[1:], ids[1:])])
    with torch.no_grad():
        logp = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), -1)
    want = logp[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    engine.close()
    return (got - want).abs().max().item()


if __name__ == "__main__":
    workdir, result = sys.argv[1], sys.argv[2]
    res = {"tied": check(workdir, True), "untied": check(workdir, False)}
    with open(result, "w") as f:
        json.dump(res, f)
