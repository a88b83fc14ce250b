"""Disaggregated rollout (``rollout.placement=disaggregated``): the last ``rollout.rollout_ranks``
processes of a job only generate, with vLLM engines of ``rollout.tensor_parallel_size``
consecutive rollout ranks each; the others only train. Both sides speak over the stateless
group that joins them (:func:`parallel.state.trainer_rollout_group`, trainers first), in steps
the trainers lead: trainer rank 0 broadcasts a command, then every rank of the group takes part
in it.

- ``generate``: every trainer contributes its prompts (an all-gather); the prompts, in trainer
  rank order, are dealt round-robin over the engines; each engine's first rank contributes its
  samples (a second all-gather) and every trainer takes back its own, in its prompt order. The
  trainers may post a request and collect its samples later (:meth:`RemoteEngine.prefetch`):
  the engines then generate while the trainers train (``rollout.max_staleness >= 1``). The first
  request after :meth:`RemoteEngine.reseed` carries its step, and every engine reseeds with it
  before generating.
- ``sync``: the resharder moves the trainers' shards into the engines' layout
  (:class:`parallel.reshard.Resharder` with ``group``), bucket by bucket, straight into the
  running engines.
- partial rollouts (``rollout.partial``): a posted request is generated in chunks
  (:class:`alignment.rollout.engines.partial.PartialGeneration`), and the sync that follows it reaches the
  engines while they generate: trainer rank 0 raises the request's flag in the group's store
  (:meth:`parallel.stateless_group.StatelessGroup.raise_flag`) before it broadcasts ``sync``; each
  engine looks for the flag between two chunks, takes the new weights, and continues its unfinished
  rows under them (an engine that finished first waits for the sync). Every posted request is followed
  by exactly one sync before its samples are collected (:mod:`launchers.loop`).

- carried partial rollouts (``rollout.partial_carry_over``, :mod:`alignment.rollout.engines.carried_remote`): the
  engines keep pools of prompt groups in flight and grow their rows between the trainers' commands, so every
  command is announced by a flag first (``command/<n>``: the ``n``-th command, counted alike on both sides), which
  a rollout rank polls between two chunks; ``carry``: every trainer's new prompts in (an all-gather), and each DP
  rank's finished groups back (a second all-gather).

Each hand-over also carries the engine's busy seconds (generating, loading weights) and idle seconds
(waiting for the trainers) since its previous one: ``rollout/engine_busy_s`` / ``rollout/engine_idle_s``
(:meth:`RemoteEngine.pop_stats`).
- ``stop``: the rollout ranks close their engines and exit.

The trainers see an ordinary :class:`alignment.rollout.base.RolloutEngine`
(:class:`RemoteEngine`); the rollout ranks run :func:`serve` until told to stop
(:func:`launchers.common.serve_as_rollout_rank` builds what it needs). This is the
layout of verl's and NeMo-RL's non-colocated generation and of slime's rollout engines.
"""

from __future__ import annotations

import time
from typing import Iterable, cast

import torch

from alignment.data.samples import OnDone, Sample, SamplingConfig, report_each
from alignment.rollout.engines.carried_remote import CarryServer
from alignment.rollout.engines.partial import PartialGeneration

GENERATE, SYNC, STOP, CARRY = "generate", "sync", "stop", "carry"


def command_flag(n: int) -> str:
    """The store flag that announces the trainers' ``n``-th command (0-based) to rollout ranks busy with carried
    partial rollouts."""
    return f"command/{n}"


def deal(prompt_lists: list[list[list[int]]], engines: int) -> list[list[tuple[int, int, list[int]]]]:
    """Every trainer's prompts (``prompt_lists[rank]``) dealt round-robin over ``engines`` engines:
    engine ``e`` gets ``[(trainer rank, index in its list, prompt ids)]``."""
    items = [(r, k, p) for r, prompts in enumerate(prompt_lists) for k, p in enumerate(prompts)]
    return [items[e::engines] for e in range(engines)]


class RemoteEngine:
    """A trainer's :class:`alignment.rollout.base.RolloutEngine` of a disaggregated job: generation
    and weights go to the rollout ranks over ``group`` (see the module docstring).

    Every trainer calls every method at the same point (each is collective over the group).
    ``tokenizer``: the policy's HF tokenizer; ``trainers``: the number of trainer ranks (the
    group's first ranks); ``partial_chunk_tokens`` > 0: posted requests are partial rollouts in
    chunks of that many tokens (``rollout.partial``; see the module docstring); ``carry``: the engines hold
    carried partial rollouts (``rollout.partial_carry_over``): every command is announced by its flag first.
    """

    shares_trainer_weights = False
    generates_per_replica = False

    def __init__(self, group, tokenizer, trainers: int, partial_chunk_tokens: int = 0, carry: bool = False):
        self.group, self.tokenizer, self.trainers = group, tokenizer, trainers
        self.partial_chunk_tokens, self.partial_requests = partial_chunk_tokens, 0
        self.announce, self.commands = carry, 0  # carried partial rollouts: each command announced by its flag
        self.posted = None  # (prompts, sampling, chunk tokens) the engines are working on
        self.engine_seconds: list[list[tuple[float, float]]] = []  # per hand-over: each engine's (busy, idle)
        self.reseeded = None  # the step of a reseed not yet sent: it goes with the next request

    def prefetch(self, prompts: list[list[int]], sampling: SamplingConfig, partial: bool = True) -> None:
        """Send the request and return at once: the engines generate while the trainers go on, and
        the next :meth:`generate` with the same arguments receives the samples. Nothing else may
        go to the rollout ranks in between (they wait to hand the samples over), except, for a
        partial rollout (``partial`` and ``partial_chunk_tokens``), one weight sync.

        Raises:
            RuntimeError: a request is already posted.
        """
        if self.posted is not None:
            raise RuntimeError("RemoteEngine.prefetch: a request is already posted; generate() receives it first")
        chunk = self.partial_chunk_tokens if partial else 0
        if chunk:
            self.partial_requests += 1
        self._send((GENERATE, sampling, self.reseeded, chunk))
        self.group.all_gather_object(prompts)
        self.posted, self.reseeded = (prompts, sampling, chunk), None

    def generate(self, prompts: list[list[int]], sampling: SamplingConfig, on_done: OnDone | None = None
                 ) -> list[list[Sample]]:
        """``sampling.n`` samples for each of this trainer's prompts, from the rollout ranks (the
        posted request's, when it is this one); ``on_done`` for each prompt once they all arrived.

        Raises:
            RuntimeError: a different request was posted (the trainers' schedule is broken).
        """
        if self.posted is None:
            self.prefetch(prompts, sampling, partial=False)
        posted, self.posted = self.posted, None
        if posted[:2] != (prompts, sampling):
            raise RuntimeError("RemoteEngine.generate: asked for other prompts or sampling than the posted request")
        out: list = [None] * len(prompts)
        handed = [part for part in self.group.all_gather_object(None)[self.trainers:] if part is not None]
        for items, _ in handed:
            for rank, k, samples in items:
                if rank == self.group.rank:
                    out[k] = samples
        self.engine_seconds.append([seconds for _, seconds in handed])
        return report_each(out, on_done)

    def _send(self, command: tuple) -> None:
        """Broadcast ``command`` to the rollout ranks (from trainer rank 0), announced by its flag first when they
        may be busy with carried partial rollouts."""
        if self.announce and self.group.rank == 0:
            self.group.raise_flag(command_flag(self.commands))
        self.commands += 1
        self.group.broadcast_object(command, 0)

    def carry(self, header: tuple, part: tuple) -> list[tuple]:
        """A carried-partial-rollout request (:class:`alignment.rollout.engines.carried_remote.RemotePool`):
        ``header`` (the same on every trainer) and this trainer's ``part`` to the rollout ranks; returns every
        engine's answer, ``[(DP rank, groups, base version, counts)]`` for all DP ranks. Collective."""
        self._send((CARRY, header, self.reseeded))
        self.reseeded = None
        self.group.all_gather_object(part)
        handed = [x for x in self.group.all_gather_object(None)[self.trainers:] if x is not None]
        self.engine_seconds.append([seconds for _, seconds in handed])
        return [answer for answers, _ in handed for answer in answers]

    def pop_stats(self) -> dict[str, float]:
        """``rollout/engine_busy_s`` and ``rollout/engine_idle_s``: the seconds an engine spent generating
        or loading weights, and waiting for the trainers, summed over the requests collected since the
        last call (each request's mean over the engines); ``{}`` when none was."""
        handovers, self.engine_seconds = self.engine_seconds, []
        if not handovers:
            return {}
        busy = sum(sum(b for b, _ in h) / len(h) for h in handovers if h)
        idle = sum(sum(i for _, i in h) / len(h) for h in handovers if h)
        return {"rollout/engine_busy_s": busy, "rollout/engine_idle_s": idle}

    def reseed(self, step: int) -> None:
        """Every engine reseeds with ``step`` (its own seed's stream,
        :meth:`alignment.rollout.engines.vllm_engine.VLLMEngine.reseed`) before the next request it gets
        (sent with it: a posted request may be running now)."""
        self.reseeded = step

    def load_resharded(self, buckets: Iterable[list[tuple[str, torch.Tensor]]]) -> dict:
        """Send this trainer's shards to the engines (the buckets of a trainer hold no tensors of
        its own: it only sends). Returns ``{"load_s": seconds, "names": []}``."""
        t0 = time.perf_counter()
        if self.posted is not None and self.posted[2] and self.group.rank == 0:  # engines generating: interrupt
            self.group.raise_flag(partial_flag(self.partial_requests))
        self._send((SYNC,))
        for _ in buckets:
            pass
        return {"load_s": time.perf_counter() - t0, "names": []}

    def update_weights(self, named_tensors) -> None:
        """Not offered: a disaggregated job's engines take new weights from the resharder only."""
        raise NotImplementedError("rollout.placement=disaggregated: weights reach the engines through the "
                                  "resharder (load_resharded), not as full tensors")

    def sleep(self) -> None:
        """Nothing to free: the engines keep their KV cache on their own ranks."""

    def wake(self) -> None:
        """Nothing to restore (see :meth:`sleep`)."""

    def close(self) -> None:
        """Stop the rollout ranks (they close their engines and exit)."""
        self._send((STOP,))


def partial_flag(request: int) -> str:
    """The store flag that interrupts partial request number ``request`` (1-based) for a weight sync."""
    return f"partial_sync/{request}"


def generate_partial(engine, prompts: list[list[int]], sampling: SamplingConfig, chunk_tokens: int,
                     sync_requested, take_sync, hold_chunks: int = 0) -> list[list[Sample]]:
    """``prompts``' samples generated in chunks of ``chunk_tokens`` by ``engine``
    (:class:`alignment.rollout.engines.partial.PartialGeneration`): after each chunk, if ``sync_requested()``,
    ``take_sync()`` loads the trainers' new weights and the unfinished rows go on under them; with no
    sync before the last chunk, ``take_sync()`` waits for it after. ``hold_chunks`` > 0 (tests:
    ``MEGALIGN_PARTIAL_HOLD_CHUNKS``): take the sync after that many chunks, waiting for it, so that an
    update surely falls inside the generation. Returns ``[prompts][n]`` samples; raises what
    ``take_sync`` raises (the trainers stopped instead)."""
    gen, updates = PartialGeneration(prompts, sampling, chunk_tokens), 0
    while gen.live():
        gen.step(engine, updates)
        if not updates and (sync_requested() or gen.chunks == hold_chunks):
            take_sync()
            updates = 1
    if not updates:
        take_sync()
    return gen.samples(engine.tokenizer)


class TimedEngine:
    """An engine whose ``generate`` and ``load_resharded`` calls are timed: :meth:`split` returns the
    seconds spent in them (busy) and the rest of the wall time (idle: waiting for the trainers) since
    the previous split. Everything else goes to the engine."""

    def __init__(self, engine):
        self.engine, self.busy, self.since = engine, 0.0, time.perf_counter()

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def _timed(self, fn, *args):
        t0 = time.perf_counter()
        try:
            return fn(*args)
        finally:
            self.busy += time.perf_counter() - t0

    def generate(self, prompts, sampling):
        return self._timed(self.engine.generate, prompts, sampling)

    def load_resharded(self, buckets):
        return self._timed(self.engine.load_resharded, buckets)

    def split(self) -> tuple[float, float]:
        now = time.perf_counter()
        busy, idle = self.busy, now - self.since - self.busy
        self.busy, self.since = 0.0, now
        return busy, idle


class TrainersStopped(Exception):
    """The trainers sent ``stop`` where a rollout rank waited for a weight sync."""


def serve(engine, resharder, group, trainers: int, engine_tp: int, hold_chunks: int = 0, carry: bool = False
          ) -> None:
    """A rollout rank's loop: run the trainers' commands (see the module docstring) on this rank's
    ``engine`` (a :class:`alignment.rollout.engines.vllm_engine.VLLMEngine`, one per ``engine_tp``
    consecutive rollout ranks) until ``stop``. ``resharder``: the receiving side of the trainers'
    :class:`parallel.reshard.Resharder` (``model=None``); ``hold_chunks``: see :func:`generate_partial`;
    ``carry``: carried partial rollouts (``rollout.partial_carry_over``, engines of one rank): the rows in flight
    grow between two commands, each announced by its flag."""
    me = group.rank - trainers
    engines = (group.size - trainers) // engine_tp
    partial_requests = commands = 0
    engine = TimedEngine(engine)  # each hand-over reports the engine's busy and idle seconds
    carried = CarryServer(engine, engines, me) if carry else None

    def take_sync() -> None:
        nonlocal commands
        command, *_ = group.broadcast_object(None, 0)
        commands += 1
        if command == STOP:
            raise TrainersStopped
        if command != SYNC:
            raise RuntimeError(f"rollout rank {group.rank}: {command!r} from the trainers during a partial rollout, "
                               "which only a weight sync may interrupt")
        engine.load_resharded(resharder.buckets())

    while True:
        while carried is not None and carried.busy() and not group.flag_raised(command_flag(commands)):
            carried.advance()  # the rows in flight grow while the trainers train
        command, *args = group.broadcast_object(None, 0)
        commands += 1
        if command == CARRY:
            header, step = args
            if step is not None:
                engine.reseed(step)
            parts = group.all_gather_object(None)[:trainers]
            answers = cast(CarryServer, carried).handle(header, parts)
            group.all_gather_object((answers, engine.split()))
        elif command == GENERATE:
            sampling, step, chunk = args
            if step is not None:
                engine.reseed(step)
            share = deal(group.all_gather_object(None)[:trainers], engines)[me // engine_tp]
            prompts = [p for _, _, p in share]
            if chunk:
                partial_requests += 1
                flag = partial_flag(partial_requests)
                try:
                    samples = generate_partial(engine, prompts, sampling, chunk, lambda: group.flag_raised(flag),
                                               take_sync, hold_chunks)
                except TrainersStopped:
                    return
            else:
                samples = engine.generate(prompts, sampling)  # collective over the engine's ranks
            first = me % engine_tp == 0
            items = [(r, k, s) for (r, k, _), s in zip(share, samples)]
            group.all_gather_object((items, engine.split()) if first else None)
        elif command == SYNC:
            engine.load_resharded(resharder.buckets())
            if carried is not None:
                carried.version += 1  # the rows go on under the new weights
        elif command == STOP:
            return
        else:
            raise RuntimeError(f"rollout rank {group.rank}: unknown command {command!r} from the trainers")

