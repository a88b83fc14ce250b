"""torchrun worker (2 processes): a bf16 model's fp32 master weights start from the fp32 checkpoint.

For each layout (DP=2 plain optimizer, DP=2 distributed optimizer, TP=2), a tiny Llama with fp32
weights off the bf16 grid is loaded three times: fp32 (the reference trajectory), bf16 with the
masters seeded by :func:`main_param_writer`, and bf16 with Megatron's masters (upcast bf16). Each
takes 3 Adam steps at a learning rate whose total update (~3e-5) is far below half a bf16 step of
the weights (~2.4e-4 at 0.1), on the same batch. With seeded masters the bf16 weights follow the
fp32 update on average: the regression slope of the bf16 change on the fp32 change is ~1. Without,
almost no bf16 weight moves (slope ~0). Also checks, per parameter, that the seeded master is
bitwise the checkpoint's fp32 value (this rank's data-parallel slice under the distributed optimizer).
Writes {"ranks": [per rank: {case: {"slope_seeded", "slope_unseeded", "moved_seeded", "moved_unseeded",
"masters_exact"}, plus the gloo collectives' and the fused CPU Adam's checks}]}: every rank's, the test
checks each (rank 1's reduce-scatter shard as well as rank 0's).
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

from alignment.models.families import get_bridge
from alignment.models.gpt import build_gpt_model, transformer_config
from alignment.models.weights import export_hf_weights, load_hf_weights
from alignment.training.megatron_step import (LogprobOutputs, OptimConfig, forward_backward, main_param_writer,
                                              setup_training,
                                              use_fused_cpu_adam)
from parallel.layout import ParallelLayout
from parallel.state import env_world, init_distributed
from tests.dist.report import every_rank, write_results_and_shutdown, exit_now
from tests.dist.tiny_llama import tiny_llama

# name: (tensor_model_parallel_size, use_distributed_optimizer)
CASES = {"dp2": (1, False), "dp2_distributed_optimizer": (1, True), "tp2": (2, False)}
LR, STEPS = 1e-5, 3


def train(hf, tp: int, distopt: bool, dtype: torch.dtype, seeded: bool,
          fused: bool = True) -> tuple[dict[str, torch.Tensor], bool]:
    """HF weights after STEPS Adam steps (fp32 copies), and whether the seeded masters were exact.
    ``fused=False``: torch's for-loop AdamW instead of the fused kernel ``setup_training`` picks."""
    cfg, bridge = hf.config, get_bridge(hf.config)
    model = build_gpt_model(cfg, transformer_config(cfg, tensor_model_parallel_size=tp, params_dtype=dtype))
    ddp, optimizer = setup_training(model, OptimConfig(lr=LR, use_distributed_optimizer=distopt))
    if not fused:
        for opt in optimizer.chained_optimizers:
            for group in opt.optimizer.param_groups:
                group["fused"] = False
    write = main_param_writer(optimizer)
    seen = []
    load_hf_weights(model, hf.state_dict(), bridge,
                    main_params=(lambda p, v: (write(p, v), seen.append((p, v.clone())))) if seeded else None)
    if not seeded:
        optimizer.reload_model_params()  # Megatron's own masters: the bf16 values upcast
    checked = [_master_equals(optimizer, p, v) for p, v in seen]
    exact = all(c is not False for c in checked) and any(checked)
    g = torch.Generator().manual_seed(3)
    batch = [{"input_ids": torch.randint(0, cfg.vocab_size, (4, 16), generator=g)}]

    def loss_fn(mb, out):
        return -out["logprobs"].mean(), {}

    for _ in range(STEPS):
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        forward_backward(ddp, batch, loss_fn, outputs=LogprobOutputs(cfg.vocab_size, 1.0), forward_only=False)
        optimizer.step()
    return {k: v.float() for k, v in export_hf_weights(model, bridge).items()}, exact


def _master_equals(optimizer, param, value) -> bool | None:
    """The optimizer's fp32 master of ``param`` is bitwise ``value`` (its slice on this DP rank);
    None when the distributed optimizer keeps no slice of it on this rank."""
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        if hasattr(opt, "shard_fp32_from_float16_groups"):
            for group, mains in zip(opt.model_float16_groups, opt.shard_fp32_from_float16_groups):
                for p, main in zip(group, mains):
                    if p is param:
                        r = opt._get_model_param_range_map(p)["param"]
                        return torch.equal(main.view(-1), value.float().reshape(-1)[r.start:r.end])
        else:
            for group, mains in zip(opt.float16_groups, opt.fp32_from_float16_groups):
                for p, main in zip(group, mains):
                    if p is param:
                        return torch.equal(main, value.float())
            return False  # the plain optimizer holds a master for every parameter
    return None


def slope(change: dict, reference: dict) -> float:
    """Least-squares slope of ``change`` on ``reference`` over every weight."""
    num = sum(float((change[k] * reference[k]).sum()) for k in reference)
    return num / sum(float((reference[k] ** 2).sum()) for k in reference)


def gloo_buffer_collectives(rank: int, world: int) -> dict[str, bool]:
    """``parallel.cpu_compat``'s in-place gloo collectives (the distributed optimizer's gradient
    reduce-scatter and parameter all-gather, on the shard views Megatron passes) against torch's own."""
    from megatron.core.distributed import param_and_grad_buffer as buffers

    g = torch.Generator().manual_seed(10 + rank)
    grads = torch.randn(world * 1000, generator=g)
    expected = torch.empty(1000)
    dist.reduce_scatter_tensor(expected, grads.clone())
    shard = grads.view(world, -1)[rank]
    buffers.dist_reduce_scatter_func(shard, grads)
    params = torch.randn(world * 1000, generator=g).bfloat16()
    gathered = torch.empty_like(params)
    dist.all_gather_into_tensor(gathered, params.view(world, -1)[rank].clone())
    buffers.dist_all_gather_func(params, params.view(world, -1)[rank])
    # an output that is not a view of the input's shard goes to torch's reduce-scatter: input unchanged
    fresh = torch.randn(world * 1000, generator=torch.Generator().manual_seed(10 + rank))
    kept, other = fresh.clone(), torch.empty(1000)
    buffers.dist_reduce_scatter_func(other, fresh)
    return {"patched": buffers.dist_reduce_scatter_func is not dist.reduce_scatter_tensor
            and buffers.dist_all_gather_func is not dist.all_gather_into_tensor,
            "reduce_scatter_exact": torch.equal(shard, expected), "all_gather_exact": torch.equal(params, gathered),
            "fallback_exact": torch.equal(other, expected) and torch.equal(fresh, kept)}


def fused_adam(hf) -> dict:
    """``use_fused_cpu_adam``: every group of the bf16 masters switched, the same 3 fp32 steps as
    torch's for-loop AdamW, and still fused after a ``load_state_dict`` of a state saved unfused."""
    fused, _ = train(hf, 1, True, torch.float32, seeded=False)
    loop, _ = train(hf, 1, True, torch.float32, seeded=False, fused=False)
    diff = max(float((fused[k] - loop[k]).abs().max()) for k in fused)
    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.AdamW([p])
    switched = use_fused_cpu_adam(opt)
    saved = opt.state_dict()
    saved["param_groups"][0]["fused"] = False
    opt.load_state_dict(saved)
    model = build_gpt_model(hf.config, transformer_config(hf.config, params_dtype=torch.bfloat16))
    _, optimizer = setup_training(model, OptimConfig(lr=LR, use_distributed_optimizer=True))
    groups = [g["fused"] for o in optimizer.chained_optimizers for g in o.optimizer.param_groups]
    return {"max_weight_diff": diff, "switched": switched, "fused_after_load": opt.param_groups[0]["fused"],
            "groups_fused": all(groups) and len(groups) > 0}


def main(out_path: str) -> None:
    rank, world, _ = env_world()
    hf = tiny_llama(seed=0)
    start = {k: v.float() for k, v in hf.state_dict().items()}
    start16 = {k: v.to(torch.bfloat16).float() for k, v in start.items()}
    results = {}
    for name, (tp, distopt) in CASES.items():
        init_distributed(ParallelLayout(world_size=world, tensor_model_parallel_size=tp))
        fp32, _ = train(hf, tp, distopt, torch.float32, seeded=False)
        seeded, exact = train(hf, tp, distopt, torch.bfloat16, seeded=True)
        unseeded, _ = train(hf, tp, distopt, torch.bfloat16, seeded=False)
        ref = {k: fp32[k] - start[k] for k in fp32}
        d_seeded = {k: seeded[k] - start16[k] for k in ref}
        d_unseeded = {k: unseeded[k] - start16[k] for k in ref}
        moved = lambda d: sum(int((v != 0).sum()) for v in d.values()) / sum(v.numel() for v in d.values())  # noqa: E731
        flags = torch.tensor([float(exact)])
        dist.all_reduce(flags, op=dist.ReduceOp.MIN)
        results[name] = {"slope_seeded": slope(d_seeded, ref), "slope_unseeded": slope(d_unseeded, ref),
                         "moved_seeded": moved(d_seeded), "moved_unseeded": moved(d_unseeded),
                         "masters_exact": bool(flags.item())}
    results["gloo_buffer_collectives"] = gloo_buffer_collectives(rank, world)
    init_distributed(ParallelLayout(world_size=world))
    results["fused_adam"] = fused_adam(hf)
    write_results_and_shutdown(out_path, {"ranks": every_rank(results)})  # rank 1's shard and collectives too


if __name__ == "__main__":
    main(sys.argv[1])
    exit_now()
