"""Partial rollouts carried across steps: a pool of prompt groups in flight, generated chunk by chunk under
whichever weights the engine holds, from which each step takes the groups that have finished.

Why: with a long tail of answer lengths, a step that waits for its batch's longest answer leaves the trainer (or,
colocated, the step) waiting on a few rows; slime's, AReaL's and verl's fully asynchronous modes instead train on
what finished and keep the rest generating under the next weights (AReaL reports 2.77x, verl 2.35-2.67x from this).

How (:class:`CarryOverPool`):

- :meth:`CarryOverPool.admit` adds a prompt (by its index in the run's prompt stream) as a group of ``n`` rows;
- :meth:`CarryOverPool.advance` generates one chunk of at most ``chunk_tokens`` tokens for every live row
  (:class:`alignment.rollout.engines.partial.PartialRow`: the engine continues prompt + the row's tokens so far),
  each token tagged with the policy version that sampled it;
- a group is ready when all its rows have ended (EOS or ``max_tokens``): GRPO's advantages need the whole group;
  :meth:`CarryOverPool.take` hands out the ready groups in the order they were admitted, as samples whose
  ``weight_updates`` count versions from the oldest token of the batch (:meth:`CarryOverPool.take` returns that
  version), so ``rollout/token_staleness`` is each token's own;
- :meth:`CarryOverPool.restart_stale` starts again, from the prompt, every row holding a token older than
  ``max_staleness`` versions behind the policy about to train (counted): no token trains more than
  ``max_staleness`` updates off-policy;
- :meth:`CarryOverPool.in_flight` is what a checkpoint keeps: the indices of the prompts admitted and not yet
  taken, which a resumed run admits again (their partial answers are not kept), so no prompt is lost or repeated.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

from alignment.data.samples import Sample, SamplingConfig
from alignment.rollout.engines.partial import PartialRow, grow_rows

__all__ = ["InFlight", "Taken", "CarryOverPool"]


@dataclass
class InFlight:
    """One prompt's group in the pool: its index in the prompt stream, its prompt, its ``n`` rows and the item it
    was admitted with (the job's problem, handed back by :meth:`CarryOverPool.take`)."""

    index: int
    prompt: list[int]
    rows: list[PartialRow]
    item: Any = None

    def ready(self, max_tokens: int) -> bool:
        """Every row ended: at its end-of-sequence token or at ``max_tokens``."""
        return all(r.finished or len(r.ids) >= max_tokens for r in self.rows)


class Taken(NamedTuple):
    """A finished group handed out by :meth:`CarryOverPool.take`: its prompt's index in the stream, the item it was
    admitted with and its ``n`` samples."""

    index: int
    item: Any
    samples: list[Sample]


class CarryOverPool:
    """The groups in flight (see the module docstring).

    Args:
        sampling: each group's sampling (``n`` rows, ``max_tokens`` per answer, temperature, ...).
        chunk_tokens: tokens per row per :meth:`advance` (``rollout.partial_chunk_tokens``).
        max_staleness: the most versions a trained token may lag the policy it trains (``rollout.max_staleness``).

    Raises:
        ValueError: ``chunk_tokens < 1`` or ``max_staleness < 0``.
    """

    def __init__(self, sampling: SamplingConfig, chunk_tokens: int, max_staleness: int):
        if chunk_tokens < 1:
            raise ValueError(f"chunk_tokens={chunk_tokens}: must be >= 1")
        if max_staleness < 0:
            raise ValueError(f"max_staleness={max_staleness}: must be >= 0")
        self.sampling, self.chunk_tokens, self.max_staleness = sampling, chunk_tokens, max_staleness
        self.groups: list[InFlight] = []
        self.restarted_rows = 0  # rows started again for staleness, since the last :meth:`pop_counts`
        self.last_taken: list[int] = []  # the indices :meth:`take` handed out last
        self.chunks = 0

    def admit(self, index: int, prompt: list[int], item: Any = None) -> None:
        """Add prompt ``index`` of the prompt stream (token ids ``prompt``; ``item``: what :meth:`take` hands back
        with it, e.g. the problem) as a group of ``sampling.n`` rows.

        Raises:
            ValueError: the prompt is in the pool already.
        """
        if any(g.index == index for g in self.groups):
            raise ValueError(f"prompt {index} is in flight already")
        rows = [PartialRow(list(prompt)) for _ in range(self.sampling.n)]
        self.groups.append(InFlight(index, list(prompt), rows, item))

    def live(self, first: int | None = None) -> list[tuple[InFlight, PartialRow]]:
        """The rows still growing, group by group in admission order (of the ``first`` groups only, when given)."""
        return [(g, r) for g in self.groups[:first] for r in g.rows
                if not r.finished and len(r.ids) < self.sampling.max_tokens]

    def due(self, needed: int) -> list[PartialRow]:
        """The rows a step asking for ``needed`` groups waits on: none when ``needed`` groups are ready, else the
        live rows of the first ``needed`` groups (admission order), whose ending alone makes ``needed`` ready."""
        return [] if len(self.ready()) >= needed else [r for _, r in self.live(needed)]

    def advance(self, engine, version: int) -> int:
        """One chunk for every live row by ``engine`` (a :class:`alignment.rollout.base.RolloutEngine`) holding the
        policy of ``version`` updates; returns the tokens added (0: nothing live)."""
        added = grow_rows(engine, [r for _, r in self.live()], self.sampling, self.chunk_tokens, version)
        self.chunks += bool(added)
        return added

    def generate(self, engine, version: int, needed: int) -> int:
        """A step's generation by ``engine`` holding the policy of ``version`` updates: the rows too stale for it
        started again (:meth:`restart_stale`), then chunks until ``needed`` groups are ready; returns the chunks.

        Raises:
            ValueError: fewer than ``needed`` groups are in flight.
            RuntimeError: the engine added no token to the live rows (no progress).
        """
        if len(self.groups) < needed:
            raise ValueError(f"{len(self.groups)} groups are in flight, {needed} are needed: admit more prompts")
        self.restart_stale(version)
        chunks = 0
        while len(self.ready()) < needed:
            if not self.advance(engine, version):
                raise RuntimeError(f"the engine added no token to {len(self.live())} live rows: {len(self.ready())} "
                                   f"of the {needed} groups needed are ready")
            chunks += 1
        return chunks

    def step(self, engine, version: int, needed: int, tokenizer) -> tuple[list[Taken], int]:
        """A step's groups: :meth:`generate` by ``engine`` holding the policy of ``version`` updates until
        ``needed`` groups are ready, then :meth:`take` of them (text decoded with ``tokenizer``)."""
        self.generate(engine, version, needed)
        return self.take(needed, tokenizer)

    def restart_stale(self, version: int) -> int:
        """Before the policy of ``version`` updates trains: start every row holding a token sampled more than
        ``max_staleness`` versions before it again from its prompt (its tokens dropped, counted in
        ``restarted_rows``); returns how many."""
        restarted = 0
        for g in self.groups:
            for k, r in enumerate(g.rows):
                if r.updates and version - min(r.updates) > self.max_staleness:
                    g.rows[k] = PartialRow(list(g.prompt))
                    restarted += 1
        self.restarted_rows += restarted
        return restarted

    def ready(self) -> list[int]:
        """The indices of the groups whose rows have all ended, in admission order."""
        return [g.index for g in self.groups if g.ready(self.sampling.max_tokens)]

    def take(self, k: int, tokenizer) -> tuple[list[Taken], int]:
        """The first ``k`` ready groups (admission order), removed from the pool: ``([Taken], base)`` where ``base`` is the oldest version of any of their tokens and each sample's ``weight_updates``
        are its tokens' versions minus ``base`` (text decoded with ``tokenizer``).

        Raises:
            ValueError: fewer than ``k`` groups are ready.
        """
        ready = [g for g in self.groups if g.ready(self.sampling.max_tokens)][:k]
        if len(ready) < k:
            raise ValueError(f"{len(ready)} groups are ready, {k} were asked for")
        self.groups = [g for g in self.groups if not any(g is r for r in ready)]
        self.last_taken = [g.index for g in ready]
        versions = [v for g in ready for r in g.rows for v in r.updates]
        base = min(versions) if versions else 0
        out = []
        for g in ready:
            samples = []
            for r in g.rows:
                text = tokenizer.decode(r.ids, skip_special_tokens=True) if tokenizer is not None else ""
                samples.append(Sample(list(g.prompt), list(r.ids), list(r.logprobs), text, r.finished,
                                      weight_updates=[v - base for v in r.updates], routed_experts=r.routed))
            out.append(Taken(g.index, g.item, samples))
        return out, base

    def in_flight(self) -> list[int]:
        """The indices of the prompts admitted and not taken (what a checkpoint keeps), in admission order."""
        return [g.index for g in self.groups]

    def pop_counts(self) -> dict[str, float]:
        """``rollout/restarted_rows`` since the last call and ``rollout/in_flight_groups`` now."""
        counts = {"rollout/restarted_rows": float(self.restarted_rows), "rollout/in_flight_groups": float(len(self.groups))}
        self.restarted_rows = 0
        return counts
