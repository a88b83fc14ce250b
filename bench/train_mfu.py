"""bf16 training-phase MFU of SFT and GRPO on one device, for a ~1B Llama-shaped model with
random weights (TinyLlama-1.1B's shape: 22 layers, hidden 2048, SwiGLU 5632, 32 query heads on
4 KV heads, vocabulary 32000). Runs the jobs' own pieces: Megatron-Core's GPTModel in bf16
(fp32 main gradients, the distributed optimizer's fp32 master weights and Adam), megalign's
``forward_backward`` with the jobs' outputs (fp32 log-softmax in token chunks) and losses on the
response positions only. Prints seconds per optimizer step, tokens/s, peak device memory and
MFU against a bf16 matmul peak measured in the same run.

    python bench/train_mfu.py [--steps 3] [--model tinyllama-1.1b|tiny] [--max-length 2048]

One step of each job (seeded random token ids):
  SFT:  32 sequences of 512-2048 tokens (a 10-30 % prompt, the loss on the rest), 8 micro-batches of 4;
  GRPO: 8 prompts of 128-384 tokens x 8 responses of 64-1024, the policy loss (advantages x
        logprobs, entropy reported) on the response tokens, 8 micro-batches of one group each.
``--max-length`` scales every length down (``tiny`` on a CPU: a smoke run of this script).

MFU = model FLOPs of the tokens the model runs on / (seconds x peak), FLOPs from
:func:`alignment.models.flops.flops_per_token` (PaLM's definition, causal attention at each
sequence's own length, the output layer only where the loss reads it).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from alignment.models.families import model_dims  # noqa: E402
from alignment.models.flops import flops_per_token, measured_matmul_peak  # noqa: E402
from alignment.models.gpt import build_gpt_model, transformer_config  # noqa: E402
from alignment.training.megatron_step import LogprobOutputs, OptimConfig, forward_backward, setup_training  # noqa: E402
from parallel.layout import ParallelLayout  # noqa: E402
from parallel.prompt_tree import tree_tokens  # noqa: E402
from parallel.state import init_distributed, shutdown  # noqa: E402

MODELS = {
    # TinyLlama-1.1B (Zhang et al. 2024): Llama-2 architecture, 1.10 B parameters, no RoPE scaling
    "tinyllama-1.1b": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
                           num_key_value_heads=4, vocab_size=32000, max_position_embeddings=4096),
    "tiny": dict(hidden_size=128, intermediate_size=352, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=1024, max_position_embeddings=4096),
}

# (name, job, packing, share_prompts)
VARIANTS = [("SFT, padded", "sft", False, False),
            ("SFT, packed", "sft", True, False),
            ("GRPO, padded", "grpo", False, False),
            ("GRPO, packed", "grpo", True, False),
            ("GRPO, packed, shared prompts (the job's default)", "grpo", True, True)]


def rows(job: str, vocab: int, scale: float, seed: int = 0):
    """One step's sequences as ``(token ids [n], prompt length)`` (GRPO: the 8 rows of a group
    share their prompt's ids), lengths multiplied by ``scale`` (at least 2 tokens each part)."""
    import torch

    g = torch.Generator().manual_seed(seed)

    def n(lo: int, hi: int) -> int:
        return max(2, int(int(torch.randint(lo, hi + 1, (1,), generator=g)) * scale))

    out = []
    if job == "sft":
        for _ in range(32):
            total = n(512, 2048)
            prompt = max(1, int(total * (0.1 + 0.2 * float(torch.rand(1, generator=g)))))
            out.append((torch.randint(0, vocab, (total,), generator=g), prompt))
        return out
    for _ in range(8):
        prompt_ids = torch.randint(0, vocab, (n(128, 384),), generator=g)
        for _ in range(8):
            response = torch.randint(0, vocab, (n(64, 1024),), generator=g)
            out.append((torch.cat([prompt_ids, response]), len(prompt_ids)))
    return out


def microbatches(seqs, per: int):
    """Right-padded host micro-batches of ``per`` rows, as the jobs hand them to
    ``forward_backward`` (it moves them to the device): ``input_ids``, ``seq_lengths``,
    ``response_lengths``, ``mask`` (1 at position t when token t + 1 is a response token) and
    ``advantages`` (one per row, from -1 to 1)."""
    import torch

    mbs = []
    for k in range(0, len(seqs), per):
        part = seqs[k:k + per]
        lengths = torch.tensor([len(ids) for ids, _ in part])
        ids = torch.zeros(len(part), int(lengths.max()), dtype=torch.long)
        mask = torch.zeros(ids.shape)
        for i, (row, prompt) in enumerate(part):
            ids[i, :len(row)] = row
            mask[i, prompt - 1:len(row) - 1] = 1
        adv = torch.linspace(-1, 1, len(part))[:, None].expand(ids.shape)
        mbs.append({"input_ids": ids, "seq_lengths": lengths, "mask": mask, "advantages": adv.contiguous(),
                    "response_lengths": lengths - torch.tensor([p for _, p in part])})
    return mbs


def model_flops(dims, seqs, mbs, share_prompts: bool) -> float:
    """Training FLOPs of one step: the tokens the model runs on (a group's prompt once with
    shared prompts) x FLOPs per token at the batch's attention-weighted length
    ``sum(T^2) / sum(T)`` (causal attention costs ``T^2`` per sequence), the output layer on the
    loss positions only."""

    lengths = [len(ids) for ids, _ in seqs]
    tokens = sum(lengths)
    ran = sum(tree_tokens(mb["input_ids"], mb["seq_lengths"], mb["seq_lengths"] - mb["response_lengths"])
              for mb in mbs) if share_prompts else tokens
    loss_positions = sum(float(mb["mask"].sum()) for mb in mbs)
    seq = sum(t * t for t in lengths) / tokens
    return ran * flops_per_token(dims, seq, output_fraction=min(1.0, loss_positions / ran))


def _profile(step, name: str, path: str, cuda: bool) -> None:
    """Append the top operators of one ``step()`` by self device time (CPU time without CUDA)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        step()
    key = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    with open(path, "a") as f:
        f.write(f"\n## {name}\n{prof.key_averages().table(sort_by=key, row_limit=20, max_name_column_width=60)}\n")


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=3, help="timed steps per variant (after one warm-up step)")
    ap.add_argument("--model", choices=sorted(MODELS), default="tinyllama-1.1b")
    ap.add_argument("--max-length", type=int, default=2048, help="scale all lengths so the longest is this")
    ap.add_argument("--variants", default="", help="comma-separated indices into the table (default: all)")
    ap.add_argument("--profile", default="", help="write each variant's top kernels of one more step to this file")
    a = ap.parse_args(argv)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29563")
    import torch
    from transformers import LlamaConfig

    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    peak = measured_matmul_peak(device, torch.bfloat16, n=8192 if cuda else 2048)
    hf = LlamaConfig(**MODELS[a.model], tie_word_embeddings=False, rope_theta=10000.0)
    dims = model_dims(hf)
    init_distributed(ParallelLayout(world_size=1))
    torch.manual_seed(0)
    model = build_gpt_model(hf, transformer_config(hf, params_dtype=torch.bfloat16))
    params = sum(p.numel() for p in model.parameters())
    ddp, optimizer = setup_training(model, OptimConfig(lr=1e-6, use_distributed_optimizer=True))
    chosen = [VARIANTS[int(i)] for i in a.variants.split(",")] if a.variants else VARIANTS
    where = torch.cuda.get_device_name() if cuda else f"CPU, {torch.get_num_threads()} thread(s)"
    print(f"\nbf16 training phase, {a.model} ({params / 1e9:.2f} B parameters, random weights), {where}, "
          f"bf16 matmul peak {peak / 1e12:.1f} TFLOP/s measured; mean of {a.steps} steps after a warm-up\n")
    print("| variant | tokens / step | s / step | tokens / s | MFU | peak allocated |\n|---|---|---|---|---|---|",
          flush=True)
    results = []
    for name, job, packing, share in chosen:
        seqs = rows(job, hf.vocab_size, a.max_length / 2048)
        data = microbatches(seqs, 4 if job == "sft" else 8)
        loss_positions = sum(float(mb["mask"].sum()) for mb in data)
        outputs = LogprobOutputs(hf.vocab_size, 1.0, entropy=job == "grpo")

        def loss_fn(mb, out):
            weight = mb["mask"] * (mb["advantages"] if job == "grpo" else 1.0)
            return -(out["logprobs"] * weight).sum() / loss_positions, {}

        def step():
            ddp.zero_grad_buffer()
            optimizer.zero_grad()
            forward_backward(ddp, data, loss_fn, outputs=outputs, forward_only=False, packing=packing,
                             positions="mask", share_prompts=share)
            optimizer.step()
            if cuda:
                torch.cuda.synchronize()

        step()
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        t = time.perf_counter()
        for _ in range(a.steps):
            step()
        seconds = (time.perf_counter() - t) / a.steps
        if a.profile:
            _profile(step, name, a.profile, cuda)
        flops = model_flops(dims, seqs, data, share)
        r = {"variant": name, "seconds": seconds, "tokens": sum(len(s) for s, _ in seqs), "mfu": flops / seconds / peak,
             "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan")}
        results.append(r)
        print(f"| {r['variant']} | {r['tokens']:,} | {r['seconds']:.3f} | {r['tokens'] / r['seconds']:,.0f} | "
              f"{100 * r['mfu']:.1f} % | {r['peak_gib']:.1f} GiB |", flush=True)
    shutdown()
    return results


if __name__ == "__main__":
    main()
