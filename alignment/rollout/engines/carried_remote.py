"""Partial rollouts carried across steps on rollout ranks of their own (``rollout.partial_carry_over`` with
``rollout.placement=disaggregated``): the pools of prompt groups in flight live beside the engines, which keep
growing their unfinished rows chunk by chunk while the trainers train, take each weight sync between two chunks,
and hand each trainer the groups that finished when its next step asks.

- :class:`RemotePool` (a trainer's): what :func:`alignment.trainers.grpo.collect_carried` asks of a pool
  (:meth:`RemotePool.admit`, :meth:`RemotePool.step`, :meth:`RemotePool.in_flight`, :meth:`RemotePool.pop_counts`),
  answered by the rollout ranks over the job's group (:meth:`alignment.rollout.engines.disaggregated.RemoteEngine.carry`).
  It keeps what the rollout ranks need not know: each prompt's item (its problem) and the prompts in flight, which
  a checkpoint keeps.
- :class:`CarryServer` (a rollout rank's): one :class:`alignment.rollout.engines.carryover.CarryOverPool` per data-parallel
  rank of the trainers that this engine serves (DP rank ``d`` is served by engine ``d % engines``). Between the
  trainers' commands it grows every live row by one chunk at the version it holds
  (:func:`alignment.rollout.engines.disaggregated.serve` polls the next command's flag between two chunks); a
  request (:meth:`CarryServer.handle`) admits the trainers' new prompts, restarts the rows too stale for the
  version about to train, grows only the rows of each DP rank's oldest groups (the ones the request can take)
  until each has the groups it needs, and takes them: the trainers wait on small, fast chunks, and the new
  prompts start growing once they train.

The rollout ranks' pools are not checkpointed: a resumed run admits the prompts in flight again
(:mod:`launchers.carried`), and their answers are generated again from the prompt.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from alignment.data.samples import SamplingConfig
from alignment.rollout.engines.carryover import CarryOverPool, Taken
from alignment.rollout.engines.partial import grow_rows

__all__ = ["RemotePool", "CarryServer"]


class RemotePool:
    """A trainer's view of its DP rank's pool on the rollout ranks (see the module docstring).

    Args:
        remote: the trainer's :class:`alignment.rollout.engines.disaggregated.RemoteEngine` (``carry=True``).
        sampling, chunk_tokens, max_staleness: as :class:`alignment.rollout.engines.carryover.CarryOverPool`'s.
        dp_rank: this trainer's data-parallel rank (the pool's owner).
        leader: whether this trainer sends its DP rank's new prompts (the first rank of its model replica; the
            others of the replica admit the same prompts and receive the same groups).
    """

    def __init__(self, remote, sampling: SamplingConfig, chunk_tokens: int, max_staleness: int, dp_rank: int,
                 leader: bool):
        self.remote, self.sampling, self.chunk_tokens, self.max_staleness = remote, sampling, chunk_tokens, max_staleness
        self.dp_rank, self.leader = dp_rank, leader
        self.items: dict[int, Any] = {}  # index -> item, admitted and not taken, in admission order
        self.pending: list[tuple[int, list[int]]] = []  # admitted since the last step: sent with the next
        self.counts: dict[str, float] = {}
        self.last_taken: list[int] = []  # the indices the last :meth:`step` received

    def admit(self, index: int, prompt: list[int], item: Any = None) -> None:
        """Admit prompt ``index`` of the stream (``prompt``: its token ids) into the rollout ranks' pool with the
        next :meth:`step`.

        Raises:
            ValueError: the prompt is in flight already.
        """
        if index in self.items:
            raise ValueError(f"prompt {index} is in flight already")
        self.items[index] = item
        self.pending.append((index, list(prompt)))

    def step(self, engine, version: int, needed: int, tokenizer) -> tuple[list[Taken], int]:  # noqa: ARG002
        """The step of the policy of ``version`` updates: the new prompts sent, and the first ``needed`` groups of
        this DP rank that finished received, as :meth:`alignment.rollout.engines.carryover.CarryOverPool.step` returns
        them (the text decoded on the rollout ranks; ``engine`` and ``tokenizer`` unused). Collective over the
        trainers and the rollout ranks."""
        admissions, self.pending = (self.pending if self.leader else []), []
        handed = self.remote.carry((version, needed, self.sampling, self.chunk_tokens, self.max_staleness),
                                   (self.dp_rank, admissions))
        [(taken, base, self.counts)] = [(t, b, c) for owner, t, b, c in handed if owner == self.dp_rank]
        self.last_taken = [g.index for g in taken]
        return [Taken(g.index, self.items.pop(g.index), g.samples) for g in taken], base

    def in_flight(self) -> list[int]:
        """The indices of the prompts admitted and not taken (what a checkpoint keeps), in admission order."""
        return list(self.items)

    def pop_counts(self) -> dict[str, float]:
        """``rollout/restarted_rows`` and ``rollout/in_flight_groups`` of this DP rank's pool, as the rollout ranks
        reported them with the last :meth:`step`."""
        counts, self.counts = self.counts, {}
        return counts


class CarryServer:
    """A rollout rank's pools, one per DP rank of the trainers it serves (see the module docstring).

    Args:
        engine: this rank's engine (``generate``, ``tokenizer``).
        engines: the number of engines; ``me``: this one's (DP rank ``d`` is served by engine ``d % engines``).
    """

    def __init__(self, engine, engines: int, me: int):
        self.engine, self.engines, self.me = engine, engines, me
        self.pools: dict[int, CarryOverPool] = {}
        self.version = 0  # the version of the weights the engine holds (set by each request, +1 per sync)

    def busy(self) -> bool:
        """Whether some row is still growing."""
        return any(p.live() for p in self.pools.values())

    def advance(self, needed: int | None = None) -> int:
        """One chunk, in one engine call at :attr:`version`, for every live row of every pool (between commands:
        the trainers train), or, while a request for ``needed`` groups a pool waits, only for the rows that request
        waits on (:meth:`alignment.rollout.engines.carryover.CarryOverPool.due`: the oldest groups' rows, not the new
        prompts', which grow once it is answered); returns the tokens added."""
        rows = [r for p in self.pools.values() for r in (p.due(needed) if needed else [r for _, r in p.live()])]
        if not rows:
            return 0
        first = next(iter(self.pools.values()))
        return grow_rows(self.engine, rows, first.sampling, first.chunk_tokens, self.version)

    def handle(self, header: tuple, parts: Sequence[tuple[int, list[tuple[int, list[int]]]]]
               ) -> list[tuple[int, list[Taken], int, dict[str, float]]]:
        """A request from every trainer (``parts``: ``(DP rank, [(index, prompt ids)] admitted)``; ``header``:
        ``(version, needed, sampling, chunk_tokens, max_staleness)``): the new prompts of this engine's DP ranks
        admitted, their rows too stale for ``version`` started again, the rows of each pool's oldest ``needed`` groups
        grown until each has ``needed`` groups finished (the new prompts wait: growing them too would slow every
        chunk the trainers wait on), and those taken: ``[(DP rank, groups, base version, counts)]`` for this engine's DP ranks."""
        version, needed, sampling, chunk_tokens, max_staleness = header
        self.version = version
        owners = sorted({dp for dp, _ in parts if dp % self.engines == self.me})
        for dp in owners:
            self.pools.setdefault(dp, CarryOverPool(sampling, chunk_tokens, max_staleness))
        for dp, admissions in parts:
            for index, prompt in admissions if dp in owners else ():
                self.pools[dp].admit(index, prompt)
        for dp in owners:
            self.pools[dp].restart_stale(version)
        while any(len(self.pools[dp].ready()) < needed for dp in owners):
            if not self.advance(needed):
                raise RuntimeError(f"rollout engine {self.me}: {needed} groups needed, but a pool holds only "
                                   f"{min(len(self.pools[dp].groups) for dp in owners)} in flight")
        out = []
        for dp in owners:
            taken, base = self.pools[dp].take(needed, self.engine.tokenizer)
            out.append((dp, taken, base, self.pools[dp].pop_counts()))
        return out
