"""torchrun worker (1 process): ``rollout.backend=megatron``'s engine (megatron-core's inference
engine on the trainer's own model, :mod:`alignment.rollout.megatron_engine`) against transformers
on the same tiny random Llama (fp32).

Writes {"greedy_equal", "eos_stop", "logprob_max_diff", "samples_differ", "shapes_ok"}.
"""

from __future__ import annotations

import json
import sys

import torch

from alignment.models.families import get_bridge
from alignment.models.gpt import build_gpt_model, transformer_config
from alignment.models.weights import load_hf_weights
from alignment.rollout.base import SamplingConfig
from alignment.rollout.megatron_engine import MegatronEngine
from parallel.layout import ParallelLayout
from parallel.state import init_distributed, shutdown
from tests.dist.tiny_llama import tiny_llama

PROMPTS = [[5, 17, 33, 101, 7], [42, 9, 200]]


def hf_logprobs(hf, prompt: list[int], response: list[int], temperature: float) -> torch.Tensor:
    """transformers' logprobs of ``response`` after ``prompt`` under softmax(logits / T)."""
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = hf(ids).logits[0, len(prompt) - 1:-1].float() / temperature
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(response)[:, None])[:, 0]


def main(out_path: str) -> None:
    torch.manual_seed(0)
    init_distributed(ParallelLayout(world_size=1))
    hf = tiny_llama(seed=0).eval()
    cfg = hf.config
    model = build_gpt_model(cfg, transformer_config(cfg, params_dtype=torch.float32))
    load_hf_weights(model, hf.state_dict(), get_bridge(cfg))
    model.train()  # as the trainer leaves it; the engine must switch to eval and back

    # greedy: transformers' greedy tokens; then stop at the first token that is not the first one,
    # kept as the last response token (as vLLM returns it) with its logprob
    with torch.no_grad():
        ref = [hf.generate(torch.tensor([p]), do_sample=False, max_new_tokens=8, eos_token_id=None,
                           pad_token_id=0)[0, len(p):].tolist() for p in PROMPTS]
    free = MegatronEngine(model, None, eos_token_id=cfg.vocab_size - 1, vocab_size=cfg.vocab_size,
                          max_model_len=64, max_batch_size=8)
    greedy = free.generate(PROMPTS, SamplingConfig(n=1, temperature=0.0, max_tokens=8))
    k = next(i for i, t in enumerate(ref[0]) if t != ref[0][0])
    eos = ref[0][k]
    stopping = MegatronEngine(model, None, eos_token_id=eos, vocab_size=cfg.vocab_size, max_model_len=64,
                              max_batch_size=8)
    stopped = stopping.generate(PROMPTS[:1], SamplingConfig(n=1, temperature=0.0, max_tokens=8))[0][0]

    # sampled at T = 0.7, 3 per prompt, in batches of 4 rows: logprobs of softmax(logits / 0.7)
    small = MegatronEngine(model, None, eos_token_id=cfg.vocab_size - 1, vocab_size=cfg.vocab_size,
                           max_model_len=64, max_batch_size=4)
    sampling = SamplingConfig(n=3, temperature=0.7, max_tokens=10)
    first, second = small.generate(PROMPTS, sampling), small.generate(PROMPTS, sampling)
    diffs = [float((torch.tensor(s.logprobs) - hf_logprobs(hf, s.prompt_ids, s.response_ids, 0.7)).abs().max())
             for group in first for s in group]
    result = {
        "greedy_equal": [s[0].response_ids for s in greedy] == ref,
        "eos_stop": stopped.response_ids == ref[0][:k + 1] and stopped.finished and len(stopped.logprobs) == k + 1,
        "logprob_max_diff": max(diffs),
        "samples_differ": [s.response_ids for g in first for s in g] != [s.response_ids for g in second for s in g],
        "shapes_ok": all(len(g) == 3 and all(len(s.logprobs) == len(s.response_ids) == 10 and not s.finished
                                             and s.prompt_ids == p for s in g) for g, p in zip(first, PROMPTS)),
        "train_mode_restored": model.training,
        "sync_is_noop": small.load_resharded([])["names"] == [],
    }
    with open(out_path, "w") as f:
        json.dump(result, f)
    shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
