"""torchrun worker (1 process): ``rollout.backend=megatron``'s engine (megatron-core's inference
engine on the trainer's own model, :mod:`alignment.rollout.engines.megatron_engine`) against transformers
on the same tiny random Llama (fp32).

Writes {"greedy_equal", "eos_stop", "logprob_max_diff", "samples_differ", "shapes_ok", ...}.
"""

from __future__ import annotations

import json
import sys
from collections import Counter

import torch

from alignment.models.families import get_bridge
from alignment.models.gpt import build_gpt_model, transformer_config
from alignment.models.weights import load_hf_weights
from alignment.data.samples import SamplingConfig
from alignment.rollout.engines.megatron_engine import MegatronEngine
from parallel.layout import ParallelLayout
from parallel.state import init_distributed, shutdown
from tests.dist.tiny_llama import tiny_llama
from tests.dist.report import exit_now

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
    # vLLM's CPU worker rebinds torch.cuda.Event when imported (a judge model in the job, an earlier
    # job of this process): the engine still times its steps and generates the same tokens
    import vllm.v1.worker.cpu.shm  # noqa: F401

    after_vllm = free.generate(PROMPTS, SamplingConfig(n=1, temperature=0.0, max_tokens=8))
    k = next(i for i, t in enumerate(ref[0]) if t != ref[0][0])
    eos = ref[0][k]
    stopping = MegatronEngine(model, None, eos_token_id=eos, vocab_size=cfg.vocab_size, max_model_len=64,
                              max_batch_size=8)
    stopped = stopping.generate(PROMPTS[:1], SamplingConfig(n=1, temperature=0.0, max_tokens=8))[0][0]

    # sampled at T = 0.7, 3 per prompt, in batches of 4 rows: logprobs of softmax(logits / 0.7)
    small = MegatronEngine(model, None, eos_token_id=cfg.vocab_size - 1, vocab_size=cfg.vocab_size,
                           max_model_len=64, max_batch_size=4, seed=7)
    sampling = SamplingConfig(n=3, temperature=0.7, max_tokens=10)
    global_rng = torch.get_rng_state()
    first = small.generate(PROMPTS, sampling)
    rng_untouched = torch.equal(torch.get_rng_state(), global_rng)
    kv_bytes = small.kv_cache_bytes()
    small.sleep()
    kv_after_sleep = small.kv_cache_bytes()
    small.wake()
    second = small.generate(PROMPTS, sampling)
    # a fresh engine with the same seed samples the same tokens (its own RNG stream); on_done gets each
    # prompt's samples once its rows are done: prompt 0's (rows 0-2) after the first batch of 4 rows
    repeat = MegatronEngine(model, None, eos_token_id=[cfg.vocab_size - 1], vocab_size=cfg.vocab_size,
                            max_model_len=64, max_batch_size=4, seed=7)
    batches, calls = [], []
    batch_generate = repeat.engine.generate
    repeat.engine.generate = lambda **kw: batches.append(1) or batch_generate(**kw)
    again = repeat.generate(PROMPTS, sampling, on_done=lambda i, samples: calls.append((i, len(batches), samples)))
    # reseeded with a step, it samples that step's stream whatever it generated before: the engine
    # that already sampled twice and a fresh one, both reseeded with 5, sample alike; step 6 anew
    def ids(groups):
        return [s.response_ids for g in groups for s in g]

    small.reseed(5)
    at5 = small.generate(PROMPTS, sampling)
    fresh = MegatronEngine(model, None, eos_token_id=[cfg.vocab_size - 1], vocab_size=cfg.vocab_size,
                           max_model_len=64, max_batch_size=4, seed=7)
    fresh.reseed(5)
    fresh_at5 = fresh.generate(PROMPTS, sampling)
    fresh.reseed(6)
    fresh_at6 = fresh.generate(PROMPTS, sampling)
    # decode steps of fixed shape (alignment.rollout.engines.static_decode; CUDA graphs on a GPU, run uncaptured here):
    # the same greedy tokens over 70 new tokens (past the first 64-position bucket), the same samples at T=0.7
    # from the same seed and the same logprobs, and again after sleep freed the KV cache (a new cache)
    static = MegatronEngine(model, None, eos_token_id=-1, vocab_size=cfg.vocab_size, max_model_len=96,
                            max_batch_size=4, seed=7, cuda_graphs=True)
    eager = MegatronEngine(model, None, eos_token_id=-1, vocab_size=cfg.vocab_size, max_model_len=96,
                           max_batch_size=4, seed=7)
    long_greedy, long_sampled = SamplingConfig(n=1, temperature=0.0, max_tokens=70), SamplingConfig(n=2, temperature=0.7, max_tokens=70)
    runs = {}
    for name, engine in (("static", static), ("eager", eager)):
        runs[name] = [engine.generate(PROMPTS, long_greedy), engine.generate(PROMPTS, long_sampled)]
        engine.sleep()
        runs[name].append(engine.generate(PROMPTS, long_sampled))
    loop_used = static.controller.loop_logprobs is not None and eager.controller.loop is None
    # stops at an EOS id: one the sampled rows draw part-way (some rows stop, others run on), the same in both
    drawn = Counter(t for g in runs["eager"][1] for s in g for t in s.response_ids[5:40])
    eos = drawn.most_common(1)[0][0]
    for name, graphs in (("static", True), ("eager", None)):
        stopping = MegatronEngine(model, None, eos_token_id=[eos, -1], vocab_size=cfg.vocab_size, max_model_len=96,
                                  max_batch_size=4, seed=7, cuda_graphs=graphs)
        runs[name].append(stopping.generate(PROMPTS, long_sampled))
    stopped_rows = [s for g in runs["eager"][-1] for s in g]
    flat = {name: [s for call in r for g in call for s in g] for name, r in runs.items()}
    diffs = [float((torch.tensor(s.logprobs) - hf_logprobs(hf, s.prompt_ids, s.response_ids, 0.7)).abs().max())
             for group in first for s in group]
    # the sampler draws from softmax(logits / T): over 2,048 one-token samples of one prompt the mean
    # logprob of the drawn token estimates E[log p(x)] = -entropy (to a few standard errors)
    wide = MegatronEngine(model, None, eos_token_id=cfg.vocab_size - 1, vocab_size=cfg.vocab_size,
                          max_model_len=64, max_batch_size=512, seed=3)
    draws = wide.generate(PROMPTS[:1], SamplingConfig(n=2048, temperature=0.7, max_tokens=1))[0]
    with torch.no_grad():
        dist0 = torch.log_softmax(hf(torch.tensor([PROMPTS[0]])).logits[0, -1].float() / 0.7, -1)
    drawn = torch.tensor([dist0[s.response_ids[0]].item() for s in draws])
    result = {
        "static_decoder_only_when_asked": static.static is not None and eager.static is None,
        "static_tokens_equal": [s.response_ids for s in flat["static"]] == [s.response_ids for s in flat["eager"]],
        "static_rows": len(flat["static"]),
        "static_loop_used": loop_used,
        "static_eos_rows": [(s.finished, len(s.response_ids), s.response_ids[-1] == eos) for s in stopped_rows],
        "static_eos_equal": [(s.response_ids, s.finished) for g in runs["static"][-1] for s in g]
        == [(s.response_ids, s.finished) for s in stopped_rows],
        "static_logprob_max_diff": max(float((torch.tensor(a.logprobs) - torch.tensor(b.logprobs)).abs().max())
                                       for a, b in zip(flat["static"], flat["eager"])),
        "sampled_mean_logprob": drawn.mean().item(),
        "neg_entropy": (dist0.exp() * dist0).sum().item(),
        "sampled_logprob_sem": (drawn.std() / len(drawn) ** 0.5).item(),
        "drawn_logprob_is_reported": max(abs(s.logprobs[0] - dist0[s.response_ids[0]].item()) for s in draws),
        "greedy_equal": [s[0].response_ids for s in greedy] == ref,
        "greedy_after_vllm_import_equal": [s[0].response_ids for s in after_vllm] == ref,
        "eos_stop": stopped.response_ids == ref[0][:k + 1] and stopped.finished and len(stopped.logprobs) == k + 1,
        "logprob_max_diff": max(diffs),
        "samples_differ": [s.response_ids for g in first for s in g] != [s.response_ids for g in second for s in g],
        "shapes_ok": all(len(g) == 3 and all(len(s.logprobs) == len(s.response_ids) == 10 and not s.finished
                                             and s.prompt_ids == p for s in g) for g, p in zip(first, PROMPTS)),
        "train_mode_restored": model.training,
        "sync_is_noop": small.load_resharded([])["names"] == [],
        "rng_untouched": rng_untouched,
        "same_seed_same_samples": ([s.response_ids for g in again for s in g]
                                   == [s.response_ids for g in first for s in g]),
        "reseed_same_stream": ids(at5) == ids(fresh_at5) and ids(at5) not in (ids(first), ids(second)),
        "reseed_other_step_differs": ids(fresh_at6) != ids(fresh_at5),
        "on_done_after_each_batch": [(i, n) for i, n, _ in calls] == [(0, 1), (1, 2)]
        and all(samples is again[i] for i, _, samples in calls),
        # keys and values, [64 positions, 4 rows, kv_heads, head_dim] fp32 per layer
        "kv_bytes": kv_bytes,
        "kv_expected": 2 * cfg.num_hidden_layers * 64 * 4 * cfg.num_key_value_heads * cfg.head_dim * 4,
        "kv_after_sleep": kv_after_sleep,
    }
    with open(out_path, "w") as f:
        json.dump(result, f)
    shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
    exit_now()
