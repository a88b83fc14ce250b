"""Routing statistics of a mixture-of-experts policy, per training step, for TensorBoard.

RL on MoE models is known to drift into a few overloaded experts (and training-inference
routing mismatch grows with it), so every step logs how evenly the training forward passes
spread tokens over experts:

* ``moe/load_imbalance``: mean over MoE layers of ``max_e load_e / mean_e load_e`` (1 = perfectly
  balanced, ``num_experts / topk`` = every token on the same ``topk`` experts), where ``load_e`` is
  the number of (token, expert) assignments of expert ``e`` over the step's global batch;
* ``moe/load_imbalance_max``: the worst layer's;
* ``moe/aux_loss``: the switch load-balancing loss (Fedus et al. 2021, eq. 4, as Megatron's
  ``switch_load_balancing_loss_func`` computes it, without the coefficient), mean over MoE layers
  and micro-batches; logged when ``model.moe_aux_loss_coeff > 0`` (Megatron computes it then only).

Counts come from forward hooks on Megatron's routers (``TopKRouter`` returns the routing map
``[tokens, experts]``), only for passes with gradients (the training passes, not logprob passes).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from parallel.names import unwrap
from parallel.state import comm_device


def track_routing(model: torch.nn.Module) -> None:
    """Install counting hooks on every router of this shard (idempotent; sizes from the model's
    ``TransformerConfig``). A dense model is left alone. Called for every trained model by
    :func:`alignment.training.megatron_step.setup_training`."""
    from megatron.core.transformer.moe.router import TopKRouter

    gpt = unwrap(model)
    experts = getattr(gpt.config, "num_moe_experts", None)
    if getattr(gpt, "_routing_counts", None) is not None or not experts:
        return
    gpt._routing_counts = torch.zeros(gpt.config.num_layers, experts, dtype=torch.float64)
    gpt._routing_calls = torch.zeros(gpt.config.num_layers, dtype=torch.float64)

    def count(router, inputs, output):
        if not torch.is_grad_enabled():
            return
        routing_map = output[1]
        if gpt._routing_counts.device != routing_map.device:  # once: count where routing runs, no host sync
            gpt._routing_counts = gpt._routing_counts.to(routing_map.device)
            gpt._routing_calls = gpt._routing_calls.to(routing_map.device)
        layer = router.layer_number - 1
        gpt._routing_counts[layer] += routing_map.sum(0)
        gpt._routing_calls[layer] += 1

    for module in gpt.modules():
        if isinstance(module, TopKRouter):
            module.register_forward_hook(count)


def routing_metrics(model: torch.nn.Module, prefix: str = "moe") -> dict[str, float]:
    """The step's ``<prefix>/*`` metrics (module doc) over all ranks, then resets the counts and
    Megatron's aux-loss tracker (shared by every model of the process: read each trained model's
    right after its updates, e.g. PPO's critic before the policy trains).
    Collective over the default group for MoE models; ``{}`` for a model without
    :func:`track_routing` (every rank must agree, as they do for one job's model)."""
    from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker, get_moe_layer_wise_logging_tracker

    gpt = unwrap(model)
    counts, calls = getattr(gpt, "_routing_counts", None), getattr(gpt, "_routing_calls", None)
    if counts is None:
        return {}
    tracked = get_moe_layer_wise_logging_tracker().get("load_balancing_loss", {}).get("values")
    aux = torch.zeros_like(calls) if tracked is None else tracked.detach()[: calls.numel()].to(calls)
    # one all-reduce: counts [L, E], calls [L], aux [L]; each token counted by the ranks routing it
    packed = torch.cat([counts.flatten(), calls, aux]).to(comm_device())
    dist.all_reduce(packed)
    packed = packed.cpu()
    n_layers, n_experts = counts.shape
    total = packed[: n_layers * n_experts].view(n_layers, n_experts)
    total_calls, total_aux = packed[n_layers * n_experts : n_layers * (n_experts + 1)], packed[-n_layers:]
    counts.zero_(), calls.zero_()
    clear_aux_losses_tracker()
    moe = total_calls > 0
    if not bool(moe.any()):
        return {}
    load = total[moe]
    imbalance = load.max(dim=1).values / load.mean(dim=1).clamp_min(1e-12)
    out = {f"{prefix}/load_imbalance": imbalance.mean().item(), f"{prefix}/load_imbalance_max": imbalance.max().item()}
    if bool(total_aux.any()):  # the same on every rank (a stage without MoE layers tracks nothing)
        out[f"{prefix}/aux_loss"] = (total_aux[moe] / total_calls[moe]).mean().item()
    return out
