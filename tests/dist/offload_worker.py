"""torchrun worker (2 processes): offloading idle models between phases changes nothing.

For each case, three GRPO-shaped steps (rollout phase with nothing resident -> reference
logprobs -> old logprobs -> one Adam step -> weight export) run twice from the same weights:
once with every unit always resident, once with :class:`DevicePlacement` moving units out and
back at every phase (forced on CPU). Every logprob, loss, grad norm and the final weights must
be bitwise equal. While offloaded, every storage of every unit must be 0 bytes, and the byte
counts of the units must match the parameter counts.
Writes {case: {"equal": bool, "policy_bytes", "optimizer_bytes", "grads_bytes", "params": int,
"reference_bytes", "freed": bool, "moved_gb": float}}.
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist

from alignment.algorithms.grpo_loss import grpo_loss
from alignment.models.families import get_bridge
from alignment.models.gpt import build_gpt_model, transformer_config
from alignment.models.weights import export_hf_weights, load_hf_weights
from alignment.trainers.rl_phases import policy_logprobs
from alignment.training.batching import split_microbatches
from alignment.training.megatron_step import LogprobOutputs, OptimConfig, forward_backward, setup_training
from alignment.training.offload import DevicePlacement, trainable
from parallel.layout import ParallelLayout
from parallel.state import env_world, init_distributed
from tests.dist.grpo_invariance_worker import CFG, make_batch
from tests.dist.tiny_llama import tiny_llama
from tests.dist.report import exit_now

# name: (tensor_model_parallel_size, use_distributed_optimizer)
CASES = {"dp2": (1, False), "dp2_distributed_optimizer": (1, True), "tp2": (2, False)}


def build(hf, tp: int, distopt: bool):
    cfg = hf.config
    bridge = get_bridge(cfg)

    def shard():
        m = build_gpt_model(cfg, transformer_config(cfg, tensor_model_parallel_size=tp, pipeline_model_parallel_size=1))
        load_hf_weights(m, hf.state_dict(), bridge)
        return m

    policy, optimizer = setup_training(shard(), OptimConfig(lr=1e-2, use_distributed_optimizer=distopt))
    reference = shard().eval().requires_grad_(False)
    return policy, optimizer, reference, bridge


def all_storages_empty(model, optimizer) -> bool:
    tensors = [*model.module.parameters(), *[p.main_grad for p in model.module.parameters()]]
    for state in optimizer.optimizer.state.values():
        tensors += [v for v in state.values() if torch.is_tensor(v)]
    return all(t.untyped_storage().nbytes() == 0 for t in tensors)


def run(hf, batch, tp: int, distopt: bool, offload: bool):
    from megatron.core import parallel_state as ps

    policy, optimizer, reference, bridge = build(hf, tp, distopt)
    place = DevicePlacement(enabled=offload, pin_memory=False)
    place.add_model("policy", policy, optimizer)
    place.add_model("reference", reference)
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    rows = batch["input_ids"].shape[0] // dp
    local = {k: v[dp_rank * rows : (dp_rank + 1) * rows] for k, v in batch.items()}
    vocab = hf.config.vocab_size
    trace, info = [], {"freed": True}
    for step in range(3):
        place.keep()  # rollout: no training model needed
        if offload and step > 0:  # from step 1 on the optimizer state exists
            info["freed"] &= all_storages_empty(policy, optimizer)
            info["offloaded_bytes"] = sum(place.resident_bytes().values())
        place.keep("reference")
        ref = policy_logprobs(reference, split_microbatches(local, 2), vocab)
        place.keep("policy")
        old = policy_logprobs(policy, split_microbatches(local, 2), vocab)
        place.keep(*trainable("policy"))
        if offload and step == 2:
            info.update({k.replace(".", "_") + "_bytes": v for k, v in place.resident_bytes().items()})

        def loss_fn(mb, out):
            lp = out["logprobs"]
            return grpo_loss(lp, mb["old"], mb["ref"], mb["advantages"], mb["response_mask"],
                             batch["response_mask"].sum(), CFG)

        local.update(ref=ref, old=old + local["old_delta"])
        policy.zero_grad_buffer()
        optimizer.zero_grad()
        out = forward_backward(policy, split_microbatches(local, 2), loss_fn, forward_only=False,
                               outputs=LogprobOutputs(vocab))
        _, grad_norm, _ = optimizer.step()
        place.keep("policy")  # weight sync reads the parameters only
        trace += [ref, old, torch.tensor([o["policy_loss_sum"].item() for o in out]), torch.tensor(float(grad_norm))]
    place.keep_all()
    weights = export_hf_weights(policy, bridge)
    info["moved_gb"] = place.pop_stats().get("offload/gb_moved", 0.0)
    info["params"] = sum(p.numel() for p in policy.module.parameters())
    return trace, weights, info


def main(path: str) -> None:
    rank, world, _ = env_world()
    hf = tiny_llama(seed=3, tie_word_embeddings=False)
    batch = make_batch(hf.config.vocab_size)
    results = {}
    for name, (tp, distopt) in CASES.items():
        init_distributed(ParallelLayout(world_size=world, tensor_model_parallel_size=tp,
                                        pipeline_model_parallel_size=1))
        base_trace, base_weights, _ = run(hf, batch, tp, distopt, offload=False)
        trace, weights, info = run(hf, batch, tp, distopt, offload=True)
        equal = all(torch.equal(a, b) for a, b in zip(base_trace, trace)) and len(trace) == len(base_trace)
        equal &= set(weights) == set(base_weights) and all(torch.equal(weights[k], base_weights[k]) for k in weights)
        changed = any(not torch.equal(weights[k], hf.state_dict()[k]) for k in weights)
        flags = torch.tensor([float(equal), float(info.pop("freed")), float(changed)])
        dist.all_reduce(flags, op=dist.ReduceOp.MIN)  # must hold on every rank
        results[name] = {"equal": bool(flags[0]), "freed": bool(flags[1]), "trained": bool(flags[2]), **info}
    if rank == 0:
        with open(path, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
    exit_now()
