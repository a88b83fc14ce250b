"""Weight-sync benchmark: Megatron shards -> vLLM, resharded rank to rank (parallel.reshard) vs
the naive path (every rank gathers the full HF state dict, then loads it), next to this
machine's memcpy bandwidth (the physical limit of any in-memory sync), measured side by side
in one run. Prints a table (rank 0).

    torchrun --standalone --nproc-per-node 2 bench/reshard.py [--model smollm2|gqa8] [--repeats 3] [--engine [--engine-tp 2]]

``--model smollm2``: SmolLM2-135M-Instruct (134.5M parameters, 538 MB in fp32; 9 heads and 3 KV
heads, so TP=1 only). ``--model gqa8``: a random Llama of the same size with 8 heads and 4 KV
heads (so TP=2 works), written once to ``$TMPDIR/megalign_bench_gqa8``. Layouts: every (TP, PP)
the world size and the model allow; destination vLLM TP 1 (the CPU engine's) and TP = world
size where the model splits (plan and movement only). ``--engine`` also loads into a running
vLLM engine per rank (or one TP=``--engine-tp`` engine over the ranks) both ways and times it.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist

from alignment.models.families import get_bridge
from alignment.models.gpt import build_gpt_model, transformer_config
from alignment.models.hf_assets import prepare_hf_dir
from alignment.models.weights import export_hf_weights, lazy_safetensors, load_hf_weights
from alignment.rollout.engines.vllm_engine import VLLMEngine
from parallel.layout import ParallelLayout
from parallel.reshard import Resharder
from parallel.state import env_world, init_distributed


def memcpy_gbps(nbytes: int = 256 << 20, repeats: int = 5) -> float:
    """Best copy bandwidth of one ``nbytes`` buffer into another, in GB/s (read + write counted once)."""
    src, dst = torch.empty(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
    src.fill_(1)
    dst.copy_(src)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return nbytes / best / 1e9


def p2p_gbps(nbytes: int = 128 << 20, repeats: int = 3) -> float:
    """Point-to-point bandwidth between ranks 0 and 1 of the default group (the transport's limit:
    gloo over loopback TCP here, NCCL on GPUs), in GB/s."""
    buf = torch.ones(nbytes, dtype=torch.uint8)
    best = float("inf")
    for _ in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        if dist.get_rank() == 0:
            dist.send(buf, 1)
        elif dist.get_rank() == 1:
            dist.recv(buf, 0)
        dist.barrier()
        best = min(best, time.perf_counter() - t0)
    return nbytes / best / 1e9


def timed(fn, repeats: int) -> float:
    """Best wall time of ``fn`` over ``repeats`` runs, all ranks in step."""
    best = float("inf")
    for _ in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        dist.barrier()
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--bucket-mb", type=int, default=64)
    ap.add_argument("--engine", action="store_true")
    ap.add_argument("--engine-tp", type=int, default=1, help="vLLM TP of the engine (> 1: one engine over the ranks)")
    args = ap.parse_args()

    from transformers import AutoConfig

    rank, world, _ = env_world()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    init_distributed(ParallelLayout(world_size=world))  # the default group, before vLLM looks for one
    hf_dir = synthetic_gqa8(rank) if args.model == "gqa8" else prepare_hf_dir(args.model)
    hf_config = AutoConfig.from_pretrained(hf_dir)
    bridge = get_bridge(hf_config)
    state = lazy_safetensors(hf_dir)
    model_bytes = 4 * sum(state[k].numel() for k in bridge_names(bridge))
    peak_copy = memcpy_gbps()
    p2p = p2p_gbps() if world > 1 else float("nan")
    engine = None
    if args.engine:

        engine = VLLMEngine(str(hf_dir), max_model_len=256, seed=rank // args.engine_tp,
                            tensor_parallel_size=args.engine_tp)
    rows = []
    for tp, pp in layouts(world, bridge.dims):
        init_distributed(ParallelLayout(world_size=world, tensor_model_parallel_size=tp,
                                        pipeline_model_parallel_size=pp))
        model = build_gpt_model(hf_config, transformer_config(hf_config, tensor_model_parallel_size=tp,
                                                              pipeline_model_parallel_size=pp))
        load_hf_weights(model, state, bridge)
        naive = timed(lambda: export_hf_weights(model, bridge), args.repeats)
        for vtp in sorted({1, world}):
            try:
                layout = bridge.vllm_layout(tp, vtp)
            except ValueError:
                continue
            r = Resharder(model, layout, vllm_tp=vtp, bucket_bytes=args.bucket_mb << 20)
            shard_bytes = 0

            def stream():
                nonlocal shard_bytes
                shard_bytes = sum(t.numel() * t.element_size() for b in r.buckets() for _, t in b)

            t_reshard = timed(stream, args.repeats)
            stats = torch.tensor([r.stats.sent_bytes / args.repeats, r.stats.peak_staged_bytes, shard_bytes],
                                 dtype=torch.float64)
            dist.all_reduce(stats, op=dist.ReduceOp.MAX)
            row = {"layout": f"TP{tp} PP{pp} DP{world // tp // pp}", "vllm_tp": vtp, "shard_mb": stats[2] / 2**20,
                   "reshard_s": t_reshard, "gbps": stats[2] / t_reshard / 1e9, "naive_s": naive,
                   "sent_mb": stats[0] / 2**20, "peak_mb": stats[1] / 2**20, "naive_extra_mb": model_bytes / 2**20}
            if engine is not None and vtp == args.engine_tp:
                row["load_reshard_s"] = timed(lambda: engine.load_resharded(r.buckets()), args.repeats)
                row["load_naive_s"] = timed(lambda: engine.update_weights(export_hf_weights(model, bridge).items()),
                                            args.repeats)
            rows.append(row)
        model = r = None  # free before the next layout is built
    if rank == 0:
        print_table(rows, peak_copy, p2p, model_bytes, world, args)
    if engine is not None:
        engine.close()


def synthetic_gqa8(rank: int):
    """An HF dir with a random SmolLM2-sized Llama (8 heads, 4 KV heads) and SmolLM2's tokenizer."""
    import tempfile
    from pathlib import Path

    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    path = Path(tempfile.gettempdir()) / "megalign_bench_gqa8"
    if rank == 0 and not (path / "config.json").exists():
        tok = AutoTokenizer.from_pretrained(prepare_hf_dir("smollm2"))
        cfg = LlamaConfig(vocab_size=len(tok), hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                          num_attention_heads=8, num_key_value_heads=4, head_dim=64, tie_word_embeddings=True,
                          torch_dtype="float32")
        torch.manual_seed(0)
        LlamaForCausalLM(cfg).save_pretrained(path)
        tok.save_pretrained(path)
    dist.barrier()
    return path


def bridge_names(bridge) -> list[str]:
    return sorted({n for mg in bridge.megatron_names() for n in bridge.hf_names(mg)})


def layouts(world: int, dims) -> list[tuple[int, int]]:
    out = []
    for tp in (1, 2, 4, 8):
        for pp in (1, 2, 4):
            if world % (tp * pp) == 0 and dims.num_query_groups % tp == 0 and dims.num_layers % pp == 0 \
                    and dims.num_attention_heads % tp == 0:
                out.append((tp, pp))
    return out


def print_table(rows, peak_copy: float, p2p: float, model_bytes: int, world: int, args) -> None:
    print(f"\nweight sync, {args.model} ({model_bytes / 2**20:.0f} MB fp32), {world} ranks, "
          f"bucket {args.bucket_mb} MB, best of {args.repeats}")
    print(f"memcpy bandwidth (every rank copying at once): {peak_copy:.2f} GB/s; "
          f"rank-to-rank send/recv: {p2p:.2f} GB/s")
    print("GB/s = this rank's vLLM shard / reshard time; above memcpy means tensors passed on without a copy\n")
    head = ["layout", "vLLM TP", "shard MB", "reshard s", "GB/s", "% memcpy", "naive gather s", "naive/reshard",
            "sent MB", "peak staged MB", "naive extra MB"]
    if any("load_reshard_s" in r for r in rows):
        head += ["engine load: reshard s", "naive s"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for r in rows:
        cells = [r["layout"], str(r["vllm_tp"]), f"{r['shard_mb']:.0f}", f"{r['reshard_s']:.3f}", f"{r['gbps']:.2f}",
                 f"{100 * r['gbps'] / peak_copy:.0f} %", f"{r['naive_s']:.3f}", f"{r['naive_s'] / r['reshard_s']:.1f}x",
                 f"{r['sent_mb']:.0f}", f"{r['peak_mb']:.0f}", f"{r['naive_extra_mb']:.0f}"]
        if "load_reshard_s" in r:
            cells += [f"{r['load_reshard_s']:.3f}", f"{r['load_naive_s']:.3f}"]
        elif len(head) > 11:
            cells += ["-", "-"]
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
