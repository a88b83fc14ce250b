"""torchrun worker: Megatron shards -> vLLM TP layout through parallel.reshard.

    torchrun --nproc-per-node 4 tests/dist/reshard_worker.py RESULT.json            # LAYOUTS, all models
    torchrun --nproc-per-node 8 tests/dist/reshard_worker.py 4x2 gqa RESULT.json    # one layout, one model
    torchrun --nproc-per-node 4 tests/dist/reshard_worker.py 2x2v2 gqa RESULT.json  # ... with virtual PP 2

For each model x training layout (TP, PP; DP = the rest; for the Qwen3-MoE model also EP and
expert TP, ``MOE_LAYOUTS``) x vLLM TP, every rank streams its
vLLM shard in small buckets; every tensor must equal what vLLM's own weight loaders put in
that vLLM rank's parameter from the full HF tensors (alignment.rollout.engines.weight_check.vllm_reference_shard).
Also measured per case: bytes sent and received (summed over ranks), the largest number of
bytes any rank staged at once, and the largest single-tensor bucket (the floor of any budget).
Writes {case: {...}}.
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM

from alignment.models.families import get_bridge
from alignment.models.gpt import build_gpt_model, transformer_config
from alignment.models.weights import load_hf_weights
from parallel.layout import ParallelLayout
from parallel.reshard import Resharder
from parallel.state import env_world, init_distributed
from alignment.rollout.engines.weight_check import vllm_reference_shard
from tests.dist.tiny_models import checkpoint_state
from tests.dist.report import exit_now

MODELS = {  # heads, KV heads, head_dim, hidden, ffn, vocab, tied; "qwen3_moe": tests.dist.tiny_models
    "gqa": (8, 4, 16, 96, 64, 512, False),
    "gqa_kv2_tied_vocab300": (4, 2, 32, 64, 80, 300, True),
    "mqa": (4, 1, 16, 48, 64, 250, False),
    "qwen3_moe": None,
}
LAYOUTS = [(1, 1), (2, 1), (4, 1), (1, 2), (2, 2)]  # (TP, PP) on 4 ranks
# (TP, PP, VPP, EP, expert TP) on 4 ranks: experts over 2 or 4 ranks, split or not over TP, with PP
MOE_LAYOUTS = [(1, 1, None, 2, None), (1, 1, None, 4, None), (2, 1, None, 2, None), (2, 1, None, 2, 1),
               (1, 2, None, 2, None)]
BUCKET = 16 << 10  # 16 KiB: many buckets even for these tiny models


def hf_model(name: str) -> LlamaForCausalLM:
    if name == "qwen3_moe":
        from tests.dist.tiny_models import tiny_qwen3_moe

        return tiny_qwen3_moe(seed=1)
    nq, nkv, hd, h, f, v, tied = MODELS[name]
    cfg = LlamaConfig(vocab_size=v, hidden_size=h, intermediate_size=f, num_hidden_layers=4, num_attention_heads=nq,
                      num_key_value_heads=nkv, head_dim=hd, tie_word_embeddings=tied, torch_dtype="float32")
    torch.manual_seed(1)
    model = LlamaForCausalLM(cfg).float()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.5)
    return model


def main(path: str, layouts: list[tuple[int, ...]], models: list[str], explicit: bool = False) -> None:
    rank, world, _ = env_world()
    results = {}
    for model_name in models:
        hf = hf_model(model_name)
        bridge = get_bridge(hf.config)
        state = checkpoint_state(hf)
        moe = bool(bridge.dims.num_experts)
        for tp, pp, *rest in (MOE_LAYOUTS if moe and not explicit else layouts):
            vpp, ep, etp = list(rest) + [None, 1, None][len(rest):]
            if bridge.dims.num_query_groups % tp:
                continue  # Megatron needs whole KV groups per TP rank
            sizes = dict(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                         sequence_parallel=moe and tp > 1, virtual_pipeline_model_parallel_size=vpp,
                         expert_model_parallel_size=ep, expert_tensor_parallel_size=etp)
            init_distributed(ParallelLayout(world_size=world, **sizes))
            tcfg = transformer_config(hf.config, **sizes)
            chunks = [build_gpt_model(hf.config, tcfg, vp_stage=v) for v in range(vpp)] if vpp else [
                build_gpt_model(hf.config, tcfg)]
            for chunk in chunks:
                load_hf_weights(chunk, state, bridge)
            model = chunks if vpp else chunks[0]
            for vtp in sorted({1, 2, 4, world}):
                resharder = Resharder(model, bridge.vllm_layout(tp, vtp, etp), vllm_tp=vtp, bucket_bytes=BUCKET)
                wrong, count = [], 0
                for bucket in resharder.buckets():
                    for name, tensor in bucket:
                        want = vllm_reference_shard(bridge, state, name, vtp, rank % vtp)
                        count += 1
                        if tensor.shape != want.shape or not torch.equal(tensor, want):
                            wrong.append(name)
                st = resharder.stats
                singles = [b.staged_bytes for b in resharder.plan.buckets if len(b.tensors) == 1]
                t = torch.tensor([len(wrong), st.sent_bytes, st.received_bytes, count], dtype=torch.float64)
                dist.all_reduce(t)
                m = torch.tensor([st.peak_staged_bytes, max(singles, default=0)], dtype=torch.float64)
                dist.all_reduce(m, op=dist.ReduceOp.MAX)
                experts = f"_ep{ep}" + (f"_etp{etp}" if etp else "") if moe else ""
                results[f"{model_name}/tp{tp}_pp{pp}{f'_vpp{vpp}' if vpp else ''}{experts}->vllm_tp{vtp}"] = {
                    "wrong": int(t[0]), "first_wrong": wrong[:3], "sent_bytes": int(t[1]), "received_bytes": int(t[2]),
                    "tensors": int(t[3]), "peak_staged_bytes": int(m[0]), "largest_single_bucket": int(m[1]),
                    "buckets": st.buckets, "moves_data": resharder.plan.moves_data,
                    "model_bytes": 4 * sum(v.numel() for v in state.values()), "world": world,
                }
            del model
    if rank == 0:
        with open(path, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    if len(sys.argv) == 4:
        tp, rest = sys.argv[1].split("x")
        pp, _, vpp = rest.partition("v")
        main(sys.argv[3], [(int(tp), int(pp), *([int(vpp)] if vpp else []))], [sys.argv[2]], explicit=True)
    else:
        main(sys.argv[1], LAYOUTS, list(MODELS))
    exit_now()
