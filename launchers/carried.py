"""``rollout.partial_carry_over`` in the loop: the pool of partial rollouts carried across steps
(:class:`alignment.rollout.engines.carryover.CarryOverPool`) with the stream positions of its prompts.

A step trains the first ``prompts_per_step / DP`` groups of this DP rank's pool that finished, oldest prompts
first (:func:`alignment.trainers.grpo.collect_carried`); the others keep generating in the next steps. For the pool
to hold more than a step takes, step ``s`` has the prompts of steps up to ``s + max_staleness`` admitted
(:func:`launchers.loop.prompts_of_step`: each step's prompts are the same as without carrying, only when they train
moves), so a step waits for the first of them to finish rather than for its longest answer. A checkpoint keeps the
prompts admitted and not yet trained and the next step to admit (:data:`IN_FLIGHT_FILE`, every DP rank's); a resumed
run admits them again first, dealt over its DP ranks (their partial answers are not kept: they are generated again
from the prompt by the resumed policy), so no prompt is lost or trained twice.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch.distributed as dist

from alignment.rollout.engines.carryover import CarryOverPool
from alignment.rollout.engines.carried_remote import RemotePool
from alignment.training.megatron_step import all_reduce_sum
from parallel.state import replica_group

#: the checkpoint file with the prompts in flight: ``{"indices": [stream positions, ascending], "next": the next
#: step whose prompts are admitted}``
IN_FLIGHT_FILE = "in_flight.json"


def saved_in_flight(checkpoint: Path) -> dict[str, Any] | None:
    """What ``checkpoint`` holds of the prompts in flight (:data:`IN_FLIGHT_FILE`, or in its first part's folder for
    a checkpoint of several models); None when it holds none."""
    found = [Path(checkpoint) / IN_FLIGHT_FILE, *sorted(Path(checkpoint).glob(f"*/{IN_FLIGHT_FILE}"))]
    path = next((p for p in found if p.is_file()), None)
    return None if path is None else json.loads(path.read_text())


class CarriedPrompts:
    """This rank's pool of prompt groups in flight, with the items they were admitted for.

    Args:
        pool: the pool (its sampling, ``rollout.partial_chunk_tokens``, ``rollout.max_staleness``), or with rollout
            ranks of their own the trainer's view of theirs.
        prompt_ids: the token ids of each of a list of items (the job's prompts for its problems).
        item_at: the item at a position of the prompt stream (:func:`launchers.loop.item_at` of the training order).
        positions: the stream positions of this DP rank's items of a step (:func:`launchers.loop.indices_of_step`).
        ahead: the steps whose prompts are admitted ahead of the step that trains (``rollout.max_staleness``).
        dp_rank, dp: this rank's data-parallel rank and the data-parallel size.
    """

    def __init__(self, pool: CarryOverPool | RemotePool, prompt_ids: Callable[[list[Any]], list[list[int]]],
                 item_at: Callable[[int], Any], positions: Callable[[int], Sequence[int]], ahead: int,
                 dp_rank: int, dp: int):
        self.pool, self.prompt_ids, self.item_at, self.positions = pool, prompt_ids, item_at, positions
        self.ahead, self.dp_rank, self.dp = ahead, dp_rank, dp
        self.next, self.end = 0, 0
        self.taken: tuple[int, list[int]] = (-1, [])  # (step, the indices taken for it)

    def start(self, step: int, end: int, saved: dict[str, Any] | None) -> None:
        """The run trains steps ``step .. end - 1``: from a fresh start (``saved`` None) nothing is admitted yet;
        resumed, the prompts in flight the checkpoint kept (``saved``: :func:`saved_in_flight`, every rank's) are
        admitted again, this DP rank's share ``indices[dp_rank::dp]``, and admission goes on from its ``next``."""
        self.end = end
        if saved is None:
            self.next = step
            return
        self.next = int(saved["next"])
        self._admit(sorted(int(i) for i in saved["indices"])[self.dp_rank::self.dp])

    def admit_through(self, step: int) -> None:
        """Admit the prompts of every step up to ``step + ahead`` (and before the run's end) not admitted yet."""
        last = min(step + self.ahead, self.end - 1)
        while self.next <= last:
            self._admit(list(self.positions(self.next)))
            self.next += 1

    def took(self, step: int, indices: list[int]) -> None:
        """The groups of prompts ``indices`` were taken for step ``step``: in flight still for a checkpoint of that
        step saved before it trains (:meth:`save`)."""
        self.taken = (step, list(indices))

    def _admit(self, indices: list[int]) -> None:
        items = [self.item_at(i) for i in indices]
        for index, item, ids in zip(indices, items, self.prompt_ids(items)):
            self.pool.admit(index, ids, item)

    def save(self, step: int) -> dict[str, str]:
        """Checkpoint ``step``'s :data:`IN_FLIGHT_FILE`: every DP rank's prompts in flight (with those taken for step
        ``step`` when it has not trained: a save before it, after a reward server failed) and the next step to
        admit (collective over every rank)."""
        untrained = self.taken[1] if self.taken[0] >= step else []
        mine = untrained + self.pool.in_flight() if replica_group().rank() == 0 else []  # the replica's hold the same
        gathered: list[list[int]] = [[] for _ in range(dist.get_world_size())]
        dist.all_gather_object(gathered, mine)
        return {IN_FLIGHT_FILE: json.dumps({"indices": sorted(i for part in gathered for i in part),
                                            "next": self.next})}

    def metrics(self, info: dict[str, float]) -> dict[str, float]:
        """``rollout/restarted_rows`` (rows started again for staleness this step) and ``rollout/in_flight_groups``
        (groups left in flight after it), summed over the DP ranks from each rank's ``info``
        (:func:`alignment.trainers.grpo.collect_carried`'s). Collective."""
        names = ("rollout/restarted_rows", "rollout/in_flight_groups")
        lead = replica_group().rank() == 0
        return dict(zip(names, all_reduce_sum([info.get(n, 0.0) if lead else 0.0 for n in names])))
