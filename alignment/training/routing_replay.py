"""MoE routing replay: the experts each token was routed to in one pass, recorded per row and
position, and forced in another pass (``algorithm.routing_replay``).

Why: a mixture-of-experts policy's router is a discrete choice. Between the pass that sampled a
token (the rollout engine) or computed its ``old_logprobs`` and the pass that trains on it, tiny
numerical differences (another kernel, bf16, another batch) flip some tokens' top-k experts, and the
PPO ratio and importance weights then compare two different sub-networks. Replaying the recorded
experts makes both passes run the same experts (R2: the old-logprob pass's routing in every update of
the batch; R3: the rollout engine's routing in every training pass; Ma et al. 2025, "Stabilizing MoE
RL by Aligning Training and Inference Routers", slime's ``--use-routing-replay`` /
``--use-rollout-routing-replay``). The gradient still flows to the router through the probabilities of
the replayed experts (their gathered scores), as Megatron's replay computes them.

How: Megatron-Core 0.16.1's routers take a ``router_replay`` object
(``megatron/core/transformer/moe/router_replay.py``) whose ``get_replay_topk`` returns the top-k
experts; :class:`parallel.router_slots.ReplaySlot` is such an object per router, set for each micro-batch from a
``[rows, seq, layers, topk]`` table (``routed_experts``, -1 where unknown) through the map from the
router's token order to (row, column) of the padded micro-batch (:func:`token_positions`: packing,
context parallelism, sequence parallelism and prompt trees alike). Every slot also counts how many
tokens the router would have chosen the same experts for (``moe/routing_agreement``).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from alignment.training.megatron_step import all_reduce_sum
from parallel.names import unwrap
from parallel.router_slots import COMPARE, RECORD, REPLAY, routers

__all__ = ["COMPARE", "RECORD", "REPLAY", "RoutingPass", "agreement", "agreement_metrics", "token_positions"]


def token_positions(inp, sequence_parallel: bool) -> torch.Tensor:
    """``[tokens]`` int64: for each token this rank's routers see, in their order (Megatron's hidden
    states are ``[s, b, h]``, flattened sequence-major; with sequence parallelism this tensor-parallel
    rank's slice of the sequence), its ``row * seq + column`` in the padded micro-batch, -1 for padding.
    ``inp``: :class:`parallel.packing.ModelInputs` or :class:`parallel.prompt_tree.SharedPromptInputs`."""
    from megatron.core import parallel_state as ps

    token_index = getattr(inp, "token_index", None)
    if token_index is not None:  # prompt trees: one packed row
        order = token_index
    else:
        order = inp.index[ps.get_context_parallel_rank()].transpose(0, 1).reshape(-1)
    tp = ps.get_tensor_model_parallel_world_size()
    if sequence_parallel and tp > 1:
        chunk = order.numel() // tp
        order = order[ps.get_tensor_model_parallel_rank() * chunk:(ps.get_tensor_model_parallel_rank() + 1) * chunk]
    return order


@dataclass
class RoutingPass:
    """One forward pass's routing over its micro-batches: ``record`` each router's choices into
    ``[rows, seq, layers, k]`` tables (:meth:`recorded_rows`), or ``replay`` / ``compare`` the tables in
    each micro-batch's ``routed_experts``. ``model``: this rank's shard; ``layers``: the model's layer
    count (the tables' third dimension), ``topk``: experts per token."""

    model: torch.nn.Module
    action: str
    layers: int
    topk: int
    records: list = field(default_factory=list)
    slots: dict = field(default_factory=dict)  # layer number -> ReplaySlot, found once per pass

    @classmethod
    def of(cls, model: torch.nn.Module, action: str) -> "RoutingPass | None":
        """The pass for ``model`` (None for a dense model: nothing to route)."""
        config = unwrap(model).config
        if not getattr(config, "num_moe_experts", None):
            return None
        return cls(model, action, config.num_layers, config.moe_router_topk)

    @contextmanager
    def micro_batch(self, mb: dict, inp, sequence_parallel: bool):
        """Around one micro-batch's forward: set every router's slot, then (``record``) keep its choices
        as a ``[rows, seq, layers, k]`` table (-1 where this rank routed nothing)."""
        if not self.slots:
            self.slots = {n: r.router_replay for n, r in routers(self.model).items()}
        slots = self.slots
        order = token_positions(inp, sequence_parallel).cpu()
        real = order >= 0
        rows, seq = inp.shape
        if self.action in (REPLAY, COMPARE):
            table = mb["routed_experts"].cpu().reshape(rows * seq, self.layers, self.topk)
            for n, slot in slots.items():
                target = table[order.clamp(min=0), n - 1].long()
                valid = real & (target >= 0).all(-1)
                # padding and unknown tokens route to the first k experts: they feed no real token
                target[~valid] = torch.arange(self.topk)
                slot.action, slot.target, slot.valid = self.action, target, valid
        else:
            for slot in slots.values():
                slot.action = RECORD
        try:
            yield
        finally:
            if self.action == RECORD:
                table = torch.full((rows * seq, self.layers, self.topk), -1, dtype=torch.int16)
                for n, slot in slots.items():
                    if slot.recorded is not None:
                        table[order[real], n - 1] = slot.recorded.cpu()[real].to(torch.int16)
                self.records.append((mb["row_index"], table.view(rows, seq, self.layers, self.topk)))
            for slot in slots.values():
                slot.action, slot.target, slot.valid, slot.recorded = None, None, None, None

    def recorded_rows(self) -> torch.Tensor:
        """The recorded tables of every micro-batch, ``[N, seq, layers, k]`` int16 in the order of the
        batch the micro-batches were split from (their ``row_index``)."""
        order = torch.cat([index for index, _ in self.records])
        return torch.cat([t for _, t in self.records]).index_select(0, torch.argsort(order))


def agreement(model: torch.nn.Module) -> tuple[float, float]:
    """``(tokens whose own top-k equalled the replayed or compared experts, tokens counted)`` summed over
    this shard's routers since the last call, then reset (each router counts its own tokens: a token
    counts once per MoE layer)."""
    agree = count = 0.0
    for router in routers(model).values():
        slot = router.router_replay
        agree, count = agree + slot.agree, count + slot.count
        slot.agree = slot.count = 0.0
    return agree, count


def agreement_metrics(model: torch.nn.Module) -> dict[str, float]:
    """``moe/routing_agreement``: the share of (token, MoE layer) pairs, over the global batch and every
    replayed or compared pass since the last call, whose own top-k experts equalled the recorded ones
    (the rollout's or the old-logprob pass's); ``{}`` when nothing was compared. Collective over all
    ranks (a token counted by one rank of its tensor-parallel group, unless sequence parallelism splits
    the tokens over it)."""
    from megatron.core import parallel_state as ps

    agree, count = agreement(model)
    counts = ps.get_tensor_model_parallel_rank() == 0 or bool(unwrap(model).config.sequence_parallel)
    agree, count = all_reduce_sum([agree if counts else 0.0, count if counts else 0.0])
    return {"moe/routing_agreement": agree / count} if count else {}
