"""torchrun worker (4 ranks): the parity matrix of context parallelism (ring attention,
Ulysses), tensor and pipeline parallelism and sequence packing.

Reference: the single-process, unpacked Megatron model with Megatron's own
``DotProductAttention`` (``core_attention="megatron"``), run by plain autograd on the whole
batch (no forward_backward, no packing code). Each case runs the same GRPO loss through
``forward_backward`` on its layout, with the batch's rows split over the data-parallel
ranks, and reports relative errors (``max |x - ref| / max |ref|``) of the logits and
logprobs at real tokens, the loss, and every parameter's gradient (HF names).

Batch: a tiny GQA Llama with non-square attention; 8 sequences of uneven lengths, some
shorter than the CP alignment (2 x CP x TP), the longer ones with a hole in their loss mask (a
multi-turn episode's tool output).
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

from alignment.algorithms.grpo_loss import GRPOLossConfig, grpo_loss
from alignment.models.families import get_bridge
from alignment.models.gpt import build_gpt_model, transformer_config
from alignment.models.weights import export_hf_weights, load_hf_weights
from alignment.training.batching import split_microbatches
from alignment.training.megatron_step import (
    LogprobOutputs,
    OptimConfig,
    forward_backward,
    is_output_rank,
    setup_training,
)
from parallel.layout import ParallelLayout
from parallel.state import env_world, init_distributed
from tests.dist.report import write_results_and_shutdown, exit_now
from tests.dist.tiny_llama import tiny_llama

CFG = GRPOLossConfig(clip_ratio=0.2, kl_coef=0.1, kl_estimator="k3", loss_agg_mode="token-mean")
LENGTHS = [5, 13, 22, 9, 16, 3, 11, 24]
SEQ = 24
PAD = 0
# name: (tp, pp, cp, cp_comm_type, packed, sequence_parallel, micro_batch_size, max_tokens_per_microbatch)
# "_response_only": the output layer on the response positions only (forward_backward's positions)
CASES = {
    "packed": (1, 1, 1, "p2p", True, False, 2, 0),
    "cp2": (1, 1, 2, "p2p", False, False, 2, 0),
    "cp2_packed": (1, 1, 2, "p2p", True, False, 2, 0),
    "cp4": (1, 1, 4, "p2p", False, False, 4, 0),
    "cp4_packed": (1, 1, 4, "p2p", True, False, 3, 0),
    "ulysses2": (1, 1, 2, "a2a", False, False, 2, 0),
    "ulysses2_packed": (1, 1, 2, "a2a", True, False, 2, 0),
    "ulysses4_packed": (1, 1, 4, "a2a", True, False, 8, 0),
    "tp2_cp2": (2, 1, 2, "p2p", False, False, 2, 0),
    "tp2_cp2_packed": (2, 1, 2, "p2p", True, False, 2, 0),
    "tp2_sp_cp2_packed": (2, 1, 2, "p2p", True, True, 4, 0),
    "tp2_ulysses2": (2, 1, 2, "a2a", False, False, 2, 0),
    "tp2_ulysses2_packed": (2, 1, 2, "a2a", True, False, 2, 0),
    "pp2_cp2": (1, 2, 2, "p2p", False, False, 2, 0),
    "pp2_cp2_packed": (1, 2, 2, "p2p", True, False, 2, 0),
    "pp2_ulysses2_packed": (1, 2, 2, "a2a", True, False, 2, 0),
    "cp2_packed_token_budget": (1, 1, 2, "p2p", True, False, 1, 40),
    "cp2_packed_response_only": (1, 1, 2, "p2p", True, False, 2, 0),
    "tp2_ulysses2_packed_response_only": (2, 1, 2, "a2a", True, False, 2, 0),
    "pp2_cp2_response_only": (1, 2, 2, "p2p", False, False, 2, 0),
}


def make_batch(vocab: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    n = len(LENGTHS)
    ids = torch.randint(1, vocab, (n, SEQ), generator=g)
    mask = torch.zeros(n, SEQ)
    for i, length in enumerate(LENGTHS):
        ids[i, length:] = PAD
        mask[i, 1 : length - 1] = 1.0  # predict tokens 2 .. length-1 (prompt of 2 tokens, or less)
        if length >= 9:  # a multi-turn episode: tokens 4-5 were a tool's output, not the model's
            mask[i, 3:5] = 0.0
    return {"input_ids": ids, "position_ids": torch.arange(SEQ).expand(n, SEQ).contiguous(),
            "seq_lengths": torch.tensor(LENGTHS), "response_mask": mask,
            "old_delta": 0.3 * torch.randn(n, SEQ, generator=g),
            "ref_logprobs": -5.5 + 0.5 * torch.randn(n, SEQ, generator=g),
            "advantages": torch.randn(n, generator=g), "rows": torch.arange(n)}


def real_positions(lengths: torch.Tensor, seq: int, shift: int = 0) -> torch.Tensor:
    """``[N, seq]`` bool: position < length - shift (shift=1: positions that have a next token)."""
    return torch.arange(seq).unsqueeze(0) < (lengths - shift).unsqueeze(1)


def reference(hf, batch, world):
    """Logits, logprobs, loss and HF-named gradients of the single-process unpacked model."""
    init_distributed(ParallelLayout(world_size=world))
    cfg = hf.config
    bridge = get_bridge(cfg)
    model = build_gpt_model(cfg, transformer_config(cfg, tensor_model_parallel_size=1, pipeline_model_parallel_size=1),
                            core_attention="megatron")
    load_hf_weights(model, hf.state_dict(), bridge)
    logits = model(batch["input_ids"], batch["position_ids"], attention_mask=None)[..., : cfg.vocab_size].float()
    targets = torch.roll(batch["input_ids"], -1, dims=1)
    lp = torch.log_softmax(logits, -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    loss, _ = grpo_loss(lp, lp.detach() + batch["old_delta"], batch["ref_logprobs"], batch["advantages"],
                        batch["response_mask"], batch["response_mask"].sum(), CFG)
    loss.backward()
    grads = export_hf_weights(model, bridge, source=lambda p: p.grad)
    return logits.detach(), lp.detach(), loss.item(), grads


def rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x - ref).abs().max() / ref.abs().max()).item()


def run_case(hf, batch, name, world, ref):
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    tp, pp, cp, comm, packed, sp, mbs, max_tokens = CASES[name]
    positions = "response_mask" if name.endswith("_response_only") else None
    layout = ParallelLayout(world_size=world, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                            context_parallel_size=cp, cp_comm_type=comm, sequence_parallel=sp)
    init_distributed(layout)
    cfg = hf.config
    bridge = get_bridge(cfg)
    model = build_gpt_model(cfg, transformer_config(
        cfg, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, context_parallel_size=cp,
        cp_comm_type=comm, sequence_parallel=sp))
    load_hf_weights(model, hf.state_dict(), bridge)
    ddp, _ = setup_training(model, OptimConfig())
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    n = batch["input_ids"].shape[0] // dp
    local = {k: v[dp_rank * n : (dp_rank + 1) * n] for k, v in batch.items()}
    total = batch["response_mask"].sum()
    logprob_outputs = LogprobOutputs(cfg.vocab_size)

    def outputs(logits, target_ids):
        full = gather_from_tensor_model_parallel_region(logits)[..., : cfg.vocab_size].detach().clone()
        return {"logits": full, **logprob_outputs(logits, target_ids)}

    def loss_fn(mb, out):
        lp = out["logprobs"]
        loss, m = grpo_loss(lp, lp.detach() + mb["old_delta"], mb["ref_logprobs"], mb["advantages"],
                            mb["response_mask"], total, CFG)
        return loss, {"loss": loss.detach(), "logits": out["logits"], "logprobs": lp.detach(), "rows": mb["rows"]}

    ddp.zero_grad_buffer()
    out = forward_backward(ddp, split_microbatches(local, mbs, max_tokens), loss_fn, outputs=outputs,
                           forward_only=False, packing=packed, positions=positions)
    ref_logits, ref_lp, ref_loss, ref_grads = ref
    errs = torch.zeros(3, dtype=torch.float64)  # logits, logprobs, loss
    if is_output_rank():
        for o in out:
            rows = o["rows"]
            lengths = batch["seq_lengths"][rows]
            real, has_next = real_positions(lengths, SEQ), real_positions(lengths, SEQ, 1)
            if positions:  # logits and logprobs exist at the response positions only
                real = has_next = batch["response_mask"][rows] > 0
            errs[0] = max(errs[0], rel(o["logits"][real], ref_logits[rows][real]))
            errs[1] = max(errs[1], rel(o["logprobs"][has_next], ref_lp[rows][has_next]))
        errs[2] = sum(o["loss"].item() for o in out)
    loss = torch.tensor([errs[2].item() if is_output_rank() else 0.0], dtype=torch.float64)
    dist.all_reduce(loss)
    errs[2] = 0.0
    dist.all_reduce(errs, op=dist.ReduceOp.MAX)
    grads = export_hf_weights(ddp, bridge, source=lambda p: p.main_grad)
    assert set(grads) == set(ref_grads), sorted(set(grads) ^ set(ref_grads))
    return {"logits_rel": errs[0].item(), "logprobs_rel": errs[1].item(),
            "loss": loss.item(), "loss_rel": abs(loss.item() - ref_loss) / abs(ref_loss),
            "grad_rel": max(rel(grads[k], ref_grads[k]) for k in grads),
            "microbatches": len(out) if is_output_rank() else None}


def main(path: str) -> None:
    rank, world, _ = env_world()
    hf = tiny_llama(seed=5, tie_word_embeddings=False)
    batch = make_batch(hf.config.vocab_size)
    ref = reference(hf, batch, world)
    results = {"reference": {"loss": ref[2], "logit_std": ref[0].std().item(),
                             "min_grad_max": min(g.abs().max().item() for g in ref[3].values())}}
    only = sys.argv[2].split(",") if len(sys.argv) > 2 else list(CASES)
    for name in only:
        results[name] = run_case(hf, batch, name, world, ref)
        if rank == 0:
            print(name, results[name], flush=True)
    write_results_and_shutdown(path, results)


if __name__ == "__main__":
    main(sys.argv[1])
    exit_now()
