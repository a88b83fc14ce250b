"""The experts a generating mixture-of-experts model routed each token to, per row and position, as
an inference engine runs its forwards (routing replay R3: ``algorithm.routing_replay=r3``,
:mod:`alignment.training.routing_replay`)."""

from __future__ import annotations

from contextlib import contextmanager

import torch

from parallel.names import unwrap
from parallel.router_slots import RECORD, routers


class GenerationRouting:
    """The routing of a generating model (R3: ``algorithm.routing_replay=r3``), recorded per row and
    position: an inference engine calls :meth:`start` before a batch of ``rows`` sequences, wraps each
    forward over a window of positions in :meth:`forward` and reads each row's ``[length, layers, k]``
    table with :meth:`rows_recorded` (-1 at positions no forward processed: the last token, which generation
    samples but never feeds back, and every dense layer).

    The routers see a window's hidden states ``[window, batch, hidden]`` flattened sequence-major
    (no sequence parallelism in generation), the same window of positions for every row (a static
    batch, :class:`alignment.rollout.engines.megatron_engine.MegatronEngine`).
    """

    def __init__(self, model: torch.nn.Module):
        config = unwrap(model).config
        self.layers, self.topk = config.num_layers, config.moe_router_topk
        self.slots = {n: r.router_replay for n, r in routers(model).items()}
        self.rows = self.length = self.position = 0
        self.table: torch.Tensor | None = None

    @classmethod
    def of(cls, model: torch.nn.Module) -> "GenerationRouting | None":
        """A recorder for ``model``, or None for a dense model."""
        return cls(model) if getattr(unwrap(model).config, "num_moe_experts", None) else None

    def start(self, rows: int, length: int) -> None:
        """A new batch of ``rows`` sequences of at most ``length`` positions (prompt + response): its
        forwards cover consecutive windows of positions from 0 (the prefill, then one decode step each)."""
        self.rows, self.length, self.position, self.table = rows, length, 0, None

    @contextmanager
    def forward(self, tokens: torch.Tensor):
        """Around one forward over the next window of positions, ``tokens`` ``[batch, window]`` (rows past
        :meth:`start`'s ``rows`` are the engine's padding and are dropped): every router's choice lands at
        ``table[row, position, layer]``, on the device the routers run on (no host sync per step)."""
        for slot in self.slots.values():
            slot.action = RECORD
        try:
            yield
        finally:
            batch, window = tokens.shape
            first, rows = self.position, min(batch, self.rows)
            self.position += window
            for n, slot in self.slots.items():
                if slot.recorded is not None:
                    if self.table is None:
                        self.table = torch.full((self.rows, self.length, self.layers, self.topk), -1,
                                                dtype=torch.int16, device=slot.recorded.device)
                    chosen = slot.recorded.view(window, batch, self.topk).transpose(0, 1)[:rows]
                    self.table[:rows, first:first + window, n - 1] = chosen.to(torch.int16)
                slot.action, slot.recorded = None, None

    def rows_recorded(self) -> list[torch.Tensor]:
        """Every row's ``[length, layers, k]`` int16 table on the host (one copy for the batch)."""
        table = (self.table.cpu() if self.table is not None
                 else torch.full((self.rows, self.length, self.layers, self.topk), -1, dtype=torch.int16))
        return list(table.unbind(0))


def earliest_routes(earlier: torch.Tensor | None, later: torch.Tensor | None) -> torch.Tensor | None:
    """A sample continued by another engine call (a multi-turn episode's next turn, a partial rollout's next
    chunk), whose ``later`` routing table ``[positions, layers, k]`` covers the positions of ``earlier``'s and
    more: each position keeps the routing of the call that first routed it (the one that sampled the token
    after it), -1 entries filled from ``later``. None when ``later`` is (the engine records no routing)."""
    if later is None:
        return None
    table = later.clone()
    if earlier is not None:
        known = earlier.shape[0]
        table[:known] = torch.where(earlier >= 0, earlier, table[:known])
    return table
