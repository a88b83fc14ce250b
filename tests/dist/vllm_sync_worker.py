"""Worker: new weights go into a running vLLM engine in memory and its logprobs then
equal transformers' on those weights, for tied and untied embeddings, through both paths:
full HF tensors (``update_weights``) and vLLM-layout tensors streamed in buckets
(``load_resharded``, what :mod:`parallel.reshard` produces), the latter with the weight check on;
a corrupted tensor must then be caught by the check.

    python tests/dist/vllm_sync_worker.py WORKDIR RESULT.json
"""

from __future__ import annotations

import json
import sys

import torch


def vllm_layout_buckets(new: dict, config, corrupt: bool = False):
    """This state dict as vLLM TP=1 tensors (Megatron TP=2 shards -> vllm_layout pieces), in 2 buckets."""
    from alignment.models.bridges.llama import LlamaDims
    from alignment.models.bridges.llama import get_bridge
    from parallel.vllm_layout import ANY_TP_RANK, assemble, vllm_tensors

    bridge = get_bridge(config)
    dims = LlamaDims.from_hf_config(config)
    shards = {}

    def shard(name, j):
        j = 0 if j == ANY_TP_RANK else j
        if (name, j) not in shards:
            shards[(name, j)] = bridge.to_megatron_shard(name, new, j, 2)
        return shards[(name, j)]

    tensors = [(t.name, assemble(t, shard)) for t in vllm_tensors(dims, 2, 1, 0)]
    if corrupt:  # swap the first two query heads of layer 1: a classic fused-QKV mistake
        name, w = next((n, w) for n, w in tensors if n == "model.layers.1.self_attn.qkv_proj.weight")
        hd = dims.head_dim
        w[:hd], w[hd : 2 * hd] = w[hd : 2 * hd].clone(), w[:hd].clone()
    half = len(tensors) // 2
    return [tensors[:half], tensors[half:]]


def check(workdir: str, tie: bool, path: str = "full") -> float:
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
    hf = AutoModelForCausalLM.from_pretrained(d).eval()
    if path == "full":
        engine.update_weights(new.items())
    else:
        from alignment.models.bridges.llama import LlamaDims
        from alignment.rollout.weight_check import check_engine_weights

        dims = LlamaDims.from_hf_config(hf.config)
        names = engine.load_resharded(vllm_layout_buckets(new, hf.config, corrupt=True))["names"]
        try:
            check_engine_weights(engine, new, dims, names)
            raise AssertionError("a corrupted QKV tensor passed the weight check")
        except RuntimeError as e:  # exactly the corrupted parameter is named
            assert "1 of" in str(e) and "model.layers.1.self_attn.qkv_proj.weight" in str(e), e
        names = engine.load_resharded(vllm_layout_buckets(new, hf.config))["names"]
        assert check_engine_weights(engine, new, dims, names) == 2 + 4 * 6 + (not tie)  # every parameter
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
    res = {"tied": check(workdir, True), "untied": check(workdir, False),
           "resharded_tied": check(workdir, True, "resharded"), "resharded_untied": check(workdir, False, "resharded")}
    with open(result, "w") as f:
        json.dump(res, f)
