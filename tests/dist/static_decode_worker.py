"""torchrun worker (2 processes, TP=2): the Megatron engine's decode steps of fixed shape
(:mod:`alignment.rollout.engines.static_decode`, the steps a GPU captures as CUDA graphs; run uncaptured here) against
its eager decode, on tensor-parallel shards (the output projection's all-reduce and the logits' gather inside
the step), fp32.

Models: a tiny Llama (untied) and a tiny Qwen3 (Q/K layernorms, tied embeddings). For each: greedy and sampled
tokens over 70 new tokens (past the first 64-position bucket), then again after ``sleep`` (a new KV cache).
Also: which models the step refuses (a Qwen3-MoE: the engine decodes it eagerly).

Writes {"ranks": [per rank: {name: {"tokens_equal", "rows", "logprob_max_diff", "static"}, "moe": {...}}]}:
each rank's own engines' tokens and logprobs, so the test checks rank 1's as well as rank 0's.
"""

from __future__ import annotations

import sys

import torch

from alignment.models.families import get_bridge
from alignment.models.gpt import build_gpt_model, transformer_config
from alignment.models.weights import load_hf_weights
from alignment.data.samples import SamplingConfig
from alignment.rollout.engines.megatron_engine import MegatronEngine
from alignment.rollout.engines.static_decode import unsupported
from parallel.layout import ParallelLayout
from parallel.state import init_distributed
from tests.dist.report import every_rank, write_results_and_shutdown, exit_now
from tests.dist.tiny_llama import tiny_llama
from tests.dist.tiny_models import checkpoint_state, tiny_qwen3, tiny_qwen3_moe_config

PROMPTS = [[5, 17, 33, 101, 7], [42, 9, 200], [3, 1, 4, 1, 5, 9, 2, 6, 5]]


def compare(hf) -> dict:
    """Eager and fixed-shape decode of the same TP=2 model: their tokens and logprobs."""
    cfg = hf.config
    model = build_gpt_model(cfg, transformer_config(cfg, tensor_model_parallel_size=2, params_dtype=torch.float32))
    load_hf_weights(model, checkpoint_state(hf), get_bridge(cfg))
    runs, engines = {}, {}
    for graphs in (True, False):
        engine = engines[graphs] = MegatronEngine(model, None, eos_token_id=-1, vocab_size=cfg.vocab_size,
                                                  max_model_len=96, max_batch_size=4, seed=11, cuda_graphs=graphs)
        calls = [engine.generate(PROMPTS, SamplingConfig(n=1, temperature=0.0, max_tokens=70)),
                 engine.generate(PROMPTS, SamplingConfig(n=2, temperature=0.8, max_tokens=70))]
        engine.sleep()
        calls.append(engine.generate(PROMPTS, SamplingConfig(n=2, temperature=0.8, max_tokens=70)))
        runs[graphs] = [s for call in calls for group in call for s in group]
    pairs = list(zip(runs[True], runs[False]))
    return {"tokens_equal": all(a.response_ids == b.response_ids for a, b in pairs), "rows": len(pairs),
            "lengths": sorted({len(a.response_ids) for a, _ in pairs}),
            "logprob_max_diff": max(float((torch.tensor(a.logprobs) - torch.tensor(b.logprobs)).abs().max())
                                    for a, b in pairs),
            "static": engines[True].static is not None and engines[False].static is None}


def main(out_path: str) -> None:
    init_distributed(ParallelLayout(world_size=2, tensor_model_parallel_size=2))
    result = {"llama": compare(tiny_llama(seed=4).eval()), "qwen3_tied": compare(tiny_qwen3(seed=5, tie_word_embeddings=True).eval())}
    moe_cfg = tiny_qwen3_moe_config()
    moe = build_gpt_model(moe_cfg, transformer_config(moe_cfg, tensor_model_parallel_size=2))
    engine = MegatronEngine(moe, None, eos_token_id=-1, vocab_size=moe_cfg.vocab_size, max_model_len=32,
                            max_batch_size=2, cuda_graphs=True)
    result["moe"] = {"unsupported": unsupported(moe), "static": engine.static is not None}
    write_results_and_shutdown(out_path, {"ranks": every_rank(result)})  # each rank's engines, compared


if __name__ == "__main__":
    main(sys.argv[1])
    exit_now()
