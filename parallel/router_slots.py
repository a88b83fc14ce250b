"""A replay slot on every Megatron-Core MoE router: what the router does with its own top-k choice in
the current forward pass (record it, replace it with given experts, or compare it with them).

Megatron-Core 0.16.1's ``TopKRouter`` asks its ``router_replay`` object, when it has one, for the top-k
experts of every forward (``moe_utils.topk_routing_with_score_function`` -> ``get_replay_topk``;
``megatron/core/transformer/moe/router_replay.py`` is Megatron's own, a global list driven by
``moe_enable_routing_replay``). :func:`routers` gives each router a :class:`ReplaySlot` of its own, which
the training passes (:mod:`alignment.training.routing_replay`) and the inference engine
(:mod:`alignment.rollout.engines.routed_experts`) set per forward. Model-agnostic: any Megatron MoE layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from parallel.names import unwrap

RECORD, REPLAY, COMPARE = "record", "replay", "compare"


@dataclass
class ReplaySlot:
    """What one router does in the current forward pass (Megatron's ``router_replay`` interface):
    ``record`` its own top-k choice into ``recorded``; ``replay`` the ``target`` experts ``[tokens, k]``;
    ``compare`` its own choice with ``target`` and keep its own; nothing (``action`` None) outside a pass.
    ``replay`` and ``compare`` count the ``valid`` tokens (``[tokens]`` bool) whose own top-k set equals
    the target's in ``agree`` / ``count``."""

    action: str | None = None
    target: torch.Tensor | None = None
    valid: torch.Tensor | None = None
    recorded: torch.Tensor | None = None
    agree: float = 0.0
    count: float = 0.0

    def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
        """Megatron's call (``moe_utils.topk_routing_with_score_function``): ``(top-k scores [tokens, k],
        top-k expert ids [tokens, k])``."""
        own = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        if self.action == RECORD:
            self.recorded = own[1].detach()
        if self.action not in (REPLAY, COMPARE):
            return own
        target = self.target.to(scores.device)
        with torch.no_grad():
            same = (own[1].sort(-1).values == target.sort(-1).values).all(-1) & self.valid.to(scores.device)
            self.agree += float(same.sum())
            self.count += float(self.valid.sum())
        if self.action == COMPARE:
            return own
        return scores.gather(1, target), target


def routers(model: torch.nn.Module) -> dict[int, torch.nn.Module]:
    """``{layer_number (1-based, global): TopKRouter}`` of this shard, each given a :class:`ReplaySlot`
    (once; Megatron then asks it for every top-k choice). ``{}`` for a dense model."""
    from megatron.core.transformer.moe.router import TopKRouter

    out = {}
    for module in unwrap(model).modules():
        if isinstance(module, TopKRouter):
            if not isinstance(module.router_replay, ReplaySlot):
                module.router_replay = ReplaySlot()
            out[module.layer_number] = module
    return out
