"""Sequence packing and context-parallelism benchmark, measured side by side in one run.
Prints two tables (rank 0).

    torchrun --standalone --nproc-per-node 2 bench/packing_cp.py [--layers 4] [--rollouts 32] [--seq-len 4096]

1. Packing vs padding on GSM8K-length rollouts: prompts are GSM8K test questions in
   SmolLM2's chat template, responses the GSM8K reference solutions, both tokenised with
   SmolLM2's tokenizer. Two data-parallel ranks; one training step (forward + backward of a
   token-mean loss over every micro-batch). Rows: padded micro-batches of
   ``--micro-batch-size`` rows (each trimmed to its longest row), the same packed (``thd``),
   and packed token-budget micro-batches (Karmarkar-Karp). Also the data-parallel token
   imbalance before and after ``balance_batch``.
2. Context parallelism at ``--seq-len``: the same global batch (2 sequences) as DP=2 (each
   rank one whole sequence), ring attention CP=2 and Ulysses CP=2 (each sequence split over
   both ranks). ``--layout dp|ring|ulysses`` runs one of them alone and adds the process's
   peak RSS (its high-water mark is only meaningful for one layout per process).

Model: a random Llama with SmolLM2-135M's widths (hidden 576, FFN 1536, vocabulary 49,152)
but 8 query / 4 KV heads of 72 (so Ulysses can split them) and ``--layers`` layers.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository root

from alignment.data.prompts import build_prompt_ids  # noqa: E402
from alignment.data.tasks import Problem, gsm8k_path  # noqa: E402
from alignment.models.gpt import build_gpt_model, transformer_config  # noqa: E402
from alignment.models.hf_assets import prepare_hf_dir  # noqa: E402
from alignment.training.batching import make_sequence_batch, split_microbatches  # noqa: E402
from alignment.training.megatron_step import LogprobOutputs, OptimConfig, forward_backward, setup_training  # noqa: E402
from parallel.balance import karmarkar_karp  # noqa: E402
from parallel.layout import ParallelLayout  # noqa: E402
from parallel.packing import model_inputs  # noqa: E402
from parallel.state import init_distributed, shutdown  # noqa: E402


def gsm8k_rollouts(n: int) -> list[tuple[list[int], int]]:
    """``n`` (token ids, prompt length) pairs: chat-templated GSM8K question + reference solution."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(prepare_hf_dir("smollm2"))
    rows = []
    with gsm8k_path().open(encoding="utf-8") as f:
        for line in f:
            row = json.loads(line)
            prompt = build_prompt_ids(tok, Problem(row["question"], "", "gsm8k"))
            rows.append((prompt + tok(row["answer"], add_special_tokens=False)["input_ids"], len(prompt)))
            if len(rows) == n:
                break
    return rows


def model_config(layers: int):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=layers,
                       num_attention_heads=8, num_key_value_heads=4, head_dim=72, max_position_embeddings=16384,
                       rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=True)


def build(hf_config, tp=1, cp=1, comm="p2p"):
    init_distributed(ParallelLayout(world_size=dist.get_world_size(), context_parallel_size=cp, cp_comm_type=comm))
    torch.manual_seed(0)
    model = build_gpt_model(hf_config, transformer_config(hf_config, tensor_model_parallel_size=tp,
                                                          pipeline_model_parallel_size=1, context_parallel_size=cp,
                                                          cp_comm_type=comm))
    ddp, _ = setup_training(model, OptimConfig())
    return ddp


def step_seconds(ddp, microbatches, vocab: int, packing: bool, repeats: int) -> float:
    """Best wall time of one forward + backward pass over ``microbatches`` (all ranks in step)."""

    tokens = sum(float(mb["loss_mask"].sum()) for mb in microbatches)

    def loss_fn(mb, out):
        return -(out["logprobs"] * mb["loss_mask"]).sum() / max(tokens, 1.0), {}

    best = float("inf")
    for _ in range(repeats):
        ddp.zero_grad_buffer()
        dist.barrier()
        t0 = time.perf_counter()
        forward_backward(ddp, microbatches, loss_fn, outputs=LogprobOutputs(vocab), forward_only=False,
                         packing=packing)
        dist.barrier()
        best = min(best, time.perf_counter() - t0)
    return best


def processed_tokens(microbatches, packing: bool) -> int:
    """Tokens the model computes on (real + padding) for these micro-batches on one CP=1 rank."""

    return sum(model_inputs(mb["input_ids"], mb["seq_lengths"], packed=packing, pad_id=0).input_ids.numel()
               for mb in microbatches)


def packing_table(args, hf_config) -> list[str]:
    rows = gsm8k_rollouts(args.rollouts)
    lengths = [len(ids) for ids, _ in rows]
    world, rank = dist.get_world_size(), dist.get_rank()
    per = len(rows) // world
    contiguous = [sum(lengths[r * per:(r + 1) * per]) for r in range(world)]
    balanced_parts = karmarkar_karp(lengths, world, equal_size=True)
    balanced = [sum(lengths[i] for i in p) for p in balanced_parts]
    mine = [rows[i] for i in balanced_parts[rank]]
    batch = make_sequence_batch(mine, pad_id=0)
    real = int(batch["seq_lengths"].sum())
    ddp = build(hf_config)
    mbs = args.micro_batch_size
    budget = mbs * max(1, int(sum(lengths) / len(lengths)))
    variants = [("padded", split_microbatches(batch, mbs), False),
                ("packed", split_microbatches(batch, mbs), True),
                (f"packed, {budget}-token budget", split_microbatches(batch, mbs, max_tokens=budget), True)]
    out = [f"## Packing vs padding: {args.rollouts} GSM8K rollouts ({min(lengths)}-{max(lengths)} tokens, "
           f"mean {sum(lengths) / len(lengths):.0f}), {world} DP ranks, {args.layers} layers",
           "", f"global batch padded to its longest row: {1 - sum(lengths) / (len(lengths) * max(lengths)):.1%} padding",
           f"DP token imbalance (max rank / mean): contiguous split {max(contiguous) / (sum(contiguous) / world):.3f}, "
           f"balance_batch (Karmarkar-Karp) {max(balanced) / (sum(balanced) / world):.3f}", "",
           "| micro-batches | count | padding | step s | tokens/s | vs padded |", "|---|---|---|---|---|---|"]
    base = None
    for name, mbl, packing in variants:
        seconds = step_seconds(ddp, mbl, hf_config.vocab_size, packing, args.repeats)
        [tps] = _sum([real / seconds])
        pad = 1 - real / processed_tokens(mbl, packing)
        base = base or tps
        out.append(f"| {name} | {len(mbl)} | {pad:.1%} | {seconds:.2f} | {tps:,.0f} | {tps / base:.2f}x |")
    return out


def _sum(values):
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t)
    return t.tolist()


def cp_table(args, hf_config) -> list[str]:
    world = dist.get_world_size()
    g = torch.Generator().manual_seed(0)
    seqs = torch.randint(1, hf_config.vocab_size, (world, args.seq_len), generator=g)
    out = [f"## Context parallelism: {world} sequences of {args.seq_len} tokens, {args.layers} layers, {world} ranks", "",
           "| layout | tokens per rank per micro-batch | step s | vs DP | peak RSS MB (rank 0) |", "|---|---|---|---|---|"]
    base = None
    layouts = {"dp": ("DP=2 (CP=1)", 1, "p2p"), "ring": ("ring CP=2", 2, "p2p"), "ulysses": ("Ulysses CP=2", 2, "a2a")}
    for name, cp, comm in ([layouts[args.layout]] if args.layout else layouts.values()):
        ddp = build(hf_config, cp=cp, comm=comm)
        from megatron.core import parallel_state as ps

        dp_rank, dp = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
        mine = seqs[dp_rank * (world // dp):(dp_rank + 1) * (world // dp)]
        mbl = [{"input_ids": s.unsqueeze(0), "seq_lengths": torch.tensor([args.seq_len]),
                "loss_mask": torch.ones(1, args.seq_len)} for s in mine]
        seconds = step_seconds(ddp, mbl, hf_config.vocab_size, False, args.repeats)
        base = base or seconds
        rss = f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:,.0f}" if args.layout else "-"
        out.append(f"| {name} | {args.seq_len // cp} | {seconds:.2f} | {base / seconds:.2f}x | {rss} |")
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--rollouts", type=int, default=32)
    ap.add_argument("--micro-batch-size", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--only", choices=["packing", "cp"], default=None)
    ap.add_argument("--layout", choices=["dp", "ring", "ulysses"], default=None, help="one CP-table layout alone")
    args = ap.parse_args()
    dist.init_process_group("gloo")
    hf_config = model_config(args.layers)
    lines = []
    if args.only in (None, "packing"):
        lines += packing_table(args, hf_config) + [""]
    if args.only in (None, "cp"):
        lines += cp_table(args, hf_config)
    if dist.get_rank() == 0:
        print("\n".join(lines), flush=True)

    shutdown()


if __name__ == "__main__":
    main()
