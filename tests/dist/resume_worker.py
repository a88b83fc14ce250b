"""torchrun worker (2 processes, DP=2): a run resumed from a Megatron checkpoint (model +
optimizer state + step) continues exactly like an uninterrupted run, with Megatron's
plain and distributed optimizer (the latter needs cpu_compat's state-loading shim); an update
with a NaN gradient on one rank is skipped on both and leaves weights and Adam state untouched.

    torchrun --nproc-per-node 2 tests/dist/resume_worker.py CKPT_DIR RESULT.json
Writes {"<optimizer>": {"resumed_vs_straight": float, "model_only_vs_straight": float, "step": int}}.
"""

from __future__ import annotations

import json
import sys


from alignment.algorithms.grpo_loss import grpo_loss
from alignment.models.families import get_bridge
from alignment.models.gpt import build_gpt_model, transformer_config
from alignment.models.weights import export_hf_weights, load_hf_weights
from alignment.training.batching import split_microbatches
from alignment.training.checkpoint import FULLY_RESHARDABLE, load_megatron_checkpoint, save_megatron_checkpoint
from alignment.training.health import guarded_step
from alignment.training.megatron_step import LogprobOutputs, OptimConfig, forward_backward, setup_training
from parallel.layout import ParallelLayout
from parallel.state import env_world, init_distributed
from tests.dist.grpo_invariance_worker import CFG, make_batch
from tests.dist.report import worst_over_ranks, write_results_and_shutdown, exit_now
from tests.dist.tiny_llama import tiny_llama
from tests.dist.tiny_models import checkpoint_state, tiny_qwen3_moe


def fresh(hf, distributed: bool, tp: int = 1, pp: int = 1, ep: int = 1):
    cfg = hf.config
    model = build_gpt_model(cfg, transformer_config(cfg, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                                    expert_model_parallel_size=ep))
    load_hf_weights(model, checkpoint_state(hf), get_bridge(cfg))  # MoE: experts one by one, as saved
    return setup_training(model, OptimConfig(lr=1e-2, use_distributed_optimizer=distributed))


def train(ddp, optimizer, hf, steps: range, poison: bool = False, stats: list | None = None) -> list[bool]:
    """Train ``steps``; ``poison``: rank 1 writes a NaN into one gradient before each update, which
    :func:`guarded_step` must skip on both ranks. Returns whether each update was applied.
    ``stats``: gets each step's ``(gradient norms per layer group, the optimizer's gradient norm)``."""
    import torch
    from megatron.core import parallel_state as ps

    applied = []
    for step in steps:
        batch = make_batch(hf.config.vocab_size)
        batch["advantages"] = batch["advantages"] * (1 + step)  # a different batch each step
        rows = batch["input_ids"].shape[0] // ps.get_data_parallel_world_size()
        r = ps.get_data_parallel_rank()
        local = {k: v[r * rows : (r + 1) * rows] for k, v in batch.items()}
        total = batch["response_mask"].sum()

        def loss_fn(mb, out):
            lp = out["logprobs"]
            return grpo_loss(lp, lp.detach() + mb["old_delta"], mb["ref_logprobs"], mb["advantages"],
                             mb["response_mask"], total, CFG)

        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        forward_backward(ddp, split_microbatches(local, 2), loss_fn, forward_only=False,
                         outputs=LogprobOutputs(hf.config.vocab_size))
        if poison and torch.distributed.get_rank() == 1:
            next(ddp.parameters()).main_grad.view(-1)[0] = float("nan")
        groups = {} if stats is not None else None
        done, norm = guarded_step(ddp, optimizer, groups)
        applied.append(done)
        if stats is not None:
            stats.append((groups, norm))
    return applied


def max_diff(a: dict, b: dict) -> float:
    """The largest difference of ``a``'s tensors from ``b``'s on any rank (collective: every rank
    compares the weights it exported)."""
    return worst_over_ranks(max((a[k] - b[k]).abs().max().item() for k in a))


def moe_resharded(ckpt_root: str, world: int, saved_ep: int, resumed_ep: int) -> dict:
    """A tiny Qwen3-MoE trained at DP 2 with ``saved_ep`` (1: each rank every expert, one optimizer;
    2: the experts shared out, an optimizer of their own), its distributed-optimizer state written
    fully reshardable after 2 steps, resumed at ``resumed_ep``: the weights after step 3 against
    the run that never changed layout, and (control) without the Adam state."""
    init_distributed(ParallelLayout(world_size=world, expert_model_parallel_size=saved_ep))
    moe = tiny_qwen3_moe(seed=1)
    bridge = get_bridge(moe.config)
    ddp, opt = fresh(moe, True, ep=saved_ep)
    train(ddp, opt, moe, range(3))
    straight = export_hf_weights(ddp, bridge)
    ddp, opt = fresh(moe, True, ep=saved_ep)
    train(ddp, opt, moe, range(2))
    ckpt = f"{ckpt_root}/moe_ep{saved_ep}/step_2"
    save_megatron_checkpoint(ddp, ckpt, optimizer=opt, step=2, sharding=FULLY_RESHARDABLE)
    init_distributed(ParallelLayout(world_size=world, expert_model_parallel_size=resumed_ep))
    ddp, opt = fresh(moe, True, ep=resumed_ep)
    step = load_megatron_checkpoint(ddp, ckpt, optimizer=opt)
    train(ddp, opt, moe, range(step, 3))
    resumed = export_hf_weights(ddp, bridge)
    ddp, opt = fresh(moe, True, ep=resumed_ep)
    load_megatron_checkpoint(ddp, ckpt)
    train(ddp, opt, moe, range(2, 3))
    return {"step": step, "resumed_vs_straight": max_diff(resumed, straight),
            "model_only_vs_straight": max_diff(export_hf_weights(ddp, bridge), straight)}


def main(ckpt_root: str, path: str) -> None:
    rank, world, _ = env_world()
    init_distributed(ParallelLayout(world_size=world))
    hf = tiny_llama(seed=4)
    bridge = get_bridge(hf.config)
    results = {}
    for distributed in (False, True):
        name = "distributed_optimizer" if distributed else "optimizer"
        ddp, opt = fresh(hf, distributed)
        stats = []
        train(ddp, opt, hf, range(3), stats=stats)
        straight = export_hf_weights(ddp, bridge)
        results[f"grad_stats_{name}"] = stats

        ddp, opt = fresh(hf, distributed)
        train(ddp, opt, hf, range(2))
        ckpt = f"{ckpt_root}/{name}/step_2"
        save_megatron_checkpoint(ddp, ckpt, optimizer=opt, step=2)
        if distributed:  # the same state written for any layout (trainer.reshard_checkpoint), resumed below
            save_megatron_checkpoint(ddp, f"{ckpt_root}/reshardable/step_2", optimizer=opt, step=2,
                                     sharding=FULLY_RESHARDABLE)
            results["straight_distributed"] = straight
        ddp, opt = fresh(hf, distributed)  # a new process would start from the initial weights
        step = load_megatron_checkpoint(ddp, ckpt, optimizer=opt)
        train(ddp, opt, hf, range(step, 3))
        resumed = export_hf_weights(ddp, bridge)

        ddp, opt = fresh(hf, distributed)  # control: model restored but Adam state lost
        load_megatron_checkpoint(ddp, ckpt)
        train(ddp, opt, hf, range(2, 3))
        model_only = max_diff(export_hf_weights(ddp, bridge), straight)

        ddp, opt = fresh(hf, distributed)  # a NaN gradient on one rank: the update is skipped everywhere
        train(ddp, opt, hf, range(2))
        before = export_hf_weights(ddp, bridge)
        skipped = train(ddp, opt, hf, range(2, 3), poison=True)
        untouched = max_diff(export_hf_weights(ddp, bridge), before)
        train(ddp, opt, hf, range(2, 3))  # then the same step, clean: as if the bad one never happened
        after_skip = max_diff(export_hf_weights(ddp, bridge), straight)
        # a checkpoint before any update was applied (the first one skipped: e.g. RFT accepting no sample, or a
        # NaN), when Adam has no state yet: saved, resumed, and the 3 steps equal the uninterrupted run's
        ddp, opt = fresh(hf, distributed)
        assert train(ddp, opt, hf, range(0, 1), poison=True) == [False]
        save_megatron_checkpoint(ddp, f"{ckpt_root}/{name}/step_0", optimizer=opt, step=0)
        ddp, opt = fresh(hf, distributed)
        first = load_megatron_checkpoint(ddp, f"{ckpt_root}/{name}/step_0", optimizer=opt)
        train(ddp, opt, hf, range(first, 3))
        results[name] = {"before_first_update_vs_straight": max_diff(export_hf_weights(ddp, bridge), straight),
                         "resumed_vs_straight": max_diff(resumed, straight), "model_only_vs_straight": model_only,
                         "step": step, "poisoned_applied": skipped, "poisoned_moved": untouched,
                         "after_skip_vs_straight": after_skip}
    import shutil
    from pathlib import Path

    import torch.distributed as dist

    damaged = Path(ckpt_root) / "damaged"  # a real checkpoint with one shard file cut short
    if dist.get_rank() == 0:
        shutil.copytree(f"{ckpt_root}/optimizer/step_2", damaged)
        shard = max(damaged.glob("*.distcp"), key=lambda p: p.stat().st_size)
        with open(shard, "r+b") as f:
            f.truncate(shard.stat().st_size // 2)
    dist.barrier()
    ddp, opt = fresh(hf, False)
    try:
        load_megatron_checkpoint(ddp, damaged, optimizer=opt)
        results["damaged_error"] = None
    except ValueError as e:
        results["damaged_error"] = str(e)
    results["manifest_files"] = sorted(json.loads((Path(ckpt_root) / "optimizer" / "step_2" / "manifest.json")
                                                  .read_text())["files"])
    ddp, opt = fresh(hf, True)  # a plain-optimizer checkpoint cannot fill a distributed optimizer
    try:
        load_megatron_checkpoint(ddp, f"{ckpt_root}/optimizer/step_2", optimizer=opt)
        results["mismatch_error"] = None
    except ValueError as e:
        results["mismatch_error"] = str(e)
    init_distributed(ParallelLayout(world_size=world, tensor_model_parallel_size=2))
    ddp, opt = fresh(hf, True, tp=2)  # distributed-optimizer state reshards over DP only
    try:
        load_megatron_checkpoint(ddp, f"{ckpt_root}/distributed_optimizer/step_2", optimizer=opt)
        results["layout_error"] = None
    except ValueError as e:
        results["layout_error"] = str(e)
    # the fully reshardable checkpoint of DP=2 resumes at TP=2 and at PP=2 (DP=1), Adam state and step kept
    straight = results.pop("straight_distributed")
    for name, sizes in (("tp2", {"tp": 2}), ("pp2", {"pp": 2})):
        layout = ParallelLayout(world_size=world, tensor_model_parallel_size=sizes.get("tp", 1),
                                pipeline_model_parallel_size=sizes.get("pp", 1))
        init_distributed(layout)
        ddp, opt = fresh(hf, True, **sizes)
        step = load_megatron_checkpoint(ddp, f"{ckpt_root}/reshardable/step_2", optimizer=opt)
        train(ddp, opt, hf, range(step, 3))
        resumed = export_hf_weights(ddp, bridge)
        ddp, opt = fresh(hf, True, **sizes)  # control: the same weights without the Adam state
        load_megatron_checkpoint(ddp, f"{ckpt_root}/reshardable/step_2")
        train(ddp, opt, hf, range(2, 3))
        results[f"resharded_{name}"] = {"step": step, "resumed_vs_straight": max_diff(resumed, straight),
                                        "model_only_vs_straight": max_diff(export_hf_weights(ddp, bridge), straight)}
    results["resharded_ep2"] = moe_resharded(ckpt_root, world, 1, 2)
    results["resharded_ep1"] = moe_resharded(ckpt_root, world, 2, 1)
    init_distributed(ParallelLayout(world_size=world, tensor_model_parallel_size=2))
    for distributed in (False, True):  # TP=2: split weights and their duplicated norms counted once
        ddp, opt = fresh(hf, distributed, tp=2)
        stats = []
        train(ddp, opt, hf, range(3), stats=stats)
        results[f"grad_stats_tp2_{'distributed_optimizer' if distributed else 'optimizer'}"] = stats
    write_results_and_shutdown(path, results)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
    exit_now()
