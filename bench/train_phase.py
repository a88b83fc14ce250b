"""One rank's GRPO training phase on SmolLM2-135M in bf16, three ways side by side in one run:
padded micro-batches with logits at every position (megalign before issue 14's second pass),
logits on the response positions only (``forward_backward(positions=...)``), and that packed
(the default now). Prints seconds per optimizer step, the ratio to the first, and MFU against
a bf16 matmul peak measured in the same run with the same thread count.

    python bench/train_phase.py [--steps 3] [--threads 1]

The batch is one rank's share of the main job's step: 32 sequences in 4 micro-batches of 8,
prompts of 40-55 tokens and responses of 8-48 (seeded), a GRPO-like loss on the response
positions, the distributed optimizer (one process: all of Adam's state here).
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
from alignment.models.hf_assets import prepare_hf_dir  # noqa: E402
from alignment.training.megatron_step import LogprobOutputs, OptimConfig, forward_backward, setup_training  # noqa: E402
from parallel.layout import ParallelLayout  # noqa: E402
from parallel.prompt_tree import tree_tokens  # noqa: E402
from parallel.state import init_distributed  # noqa: E402

# (name, packing, positions, share_prompts, micro-batches per step)
VARIANTS = [("padded, logits everywhere", False, None, False, 4),
            ("padded, logits on responses", False, "mask", False, 4),
            ("packed, logits on responses", True, "mask", False, 4),
            ("shared prompts, 4 micro-batches of 8 (default)", True, "mask", True, 4),
            ("shared prompts, 1 micro-batch of 32", True, "mask", True, 1)]


def batch(seed: int = 0, micro_batches: int = 4):
    """4 GRPO groups of 8 rows (each group one prompt), as ``micro_batches`` micro-batches:
    ``input_ids``, ``seq_lengths``, ``response_lengths``, ``mask`` (response positions)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    groups = []
    for _ in range(4):
        prompt = int(torch.randint(40, 56, (1,), generator=g))
        response = torch.randint(8, 49, (8,), generator=g)
        prompt_ids = torch.randint(0, 49152, (prompt,), generator=g)
        groups.append([(torch.cat([prompt_ids, torch.randint(0, 49152, (int(r),), generator=g)]), prompt)
                       for r in response])
    rows = [row for group in groups for row in group]
    per = len(rows) // micro_batches
    mbs = []
    for k in range(micro_batches):
        part = rows[k * per:(k + 1) * per]
        lengths = torch.tensor([len(ids) for ids, _ in part])
        ids = torch.zeros(len(part), int(lengths.max()), dtype=torch.long)
        mask = torch.zeros(ids.shape)
        for i, (row, prompt) in enumerate(part):
            ids[i, :len(row)] = row
            mask[i, prompt - 1:len(row) - 1] = 1  # position t scores token t + 1
        mbs.append({"input_ids": ids, "seq_lengths": lengths, "mask": mask,
                    "response_lengths": lengths - torch.tensor([p for _, p in part])})
    return mbs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=3, help="timed steps per variant (after one warm-up step)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (the main job: one per rank on 2 cores)")
    a = ap.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29561")
    import torch
    from transformers import AutoConfig

    torch.set_num_threads(a.threads)
    peak = measured_matmul_peak("cpu", torch.bfloat16)
    hf = AutoConfig.from_pretrained(prepare_hf_dir("smollm2"))
    init_distributed(ParallelLayout(world_size=1))
    model = build_gpt_model(hf, transformer_config(hf, params_dtype=torch.bfloat16))
    ddp, optimizer = setup_training(model, OptimConfig(lr=1e-6, use_distributed_optimizer=True))

    mbs = batch()
    tokens = sum(int(mb["seq_lengths"].sum()) for mb in mbs)
    response = sum(float(mb["mask"].sum()) for mb in mbs)

    def model_flops(share_prompts: bool) -> float:
        """FLOPs of the tokens the model runs on (a group's prompt once with shared prompts)."""
        ran = sum(tree_tokens(mb["input_ids"], mb["seq_lengths"], mb["seq_lengths"] - mb["response_lengths"])
                  for mb in mbs) if share_prompts else tokens
        return ran * flops_per_token(model_dims(hf), tokens / 32, output_fraction=response / ran)

    def loss_fn(mb, out):
        return -(out["logprobs"] * mb["mask"]).sum() / response, {}

    rows = []
    for name, packing, positions, share, micro_batches in VARIANTS:
        data = batch(micro_batches=micro_batches)

        def step():
            ddp.zero_grad_buffer()
            optimizer.zero_grad()
            forward_backward(ddp, data, loss_fn, outputs=LogprobOutputs(hf.vocab_size, 0.7, entropy=True),
                             forward_only=False, packing=packing, positions=positions, share_prompts=share)
            optimizer.step()

        step()
        t = time.perf_counter()
        for _ in range(a.steps):
            step()
        rows.append((name, (time.perf_counter() - t) / a.steps, model_flops(share)))
    print(f"\nOne rank's GRPO training phase, SmolLM2-135M bf16, 4 groups of 8, {tokens} tokens "
          f"({response:.0f} response); {a.threads} thread(s), bf16 matmul peak {peak / 1e9:.0f} GFLOP/s\n")
    print("| variant | s / step | vs first | MFU |\n|---|---|---|---|")
    for name, s, flops in rows:
        print(f"| {name} | {s:.2f} | {rows[0][1] / s:.2f}x | {100 * flops / s / peak:.0f} % |")


if __name__ == "__main__":
    main()
