"""Reshard Megatron training shards into vLLM's tensor-parallel layout, rank to rank, in
bounded buckets, without gathering the full model anywhere.

Every rank computes the same plan (deterministic, no coordinator; cached for the run):
  1. each rank publishes which Megatron parameters it holds (global names, TP/PP/DP
     coordinates, shapes): one ``all_gather_object`` when the plan is built;
  2. for every destination rank ``d`` (vLLM TP rank ``d % vllm_tp``) and every target tensor of
     the target layout (a callable given by the model family: vLLM TP rank -> its tensors as
     :class:`parallel.pieces.Piece` s of Megatron shards), each piece gets a source rank: ``d``
     itself when it holds the piece, else a rank of ``d``'s own data-parallel replica that
     does (so traffic stays inside one model-parallel group), else the holder nearest to ``d``;
  3. tensors are cut into buckets so that, on every rank, the destination tensors of a bucket
     plus its send and receive buffers stay within ``bucket_bytes`` (a tensor larger than
     that forms a bucket of its own).
Per bucket, each rank packs the slices others need into one buffer per peer (a single row
range goes as a view of the parameter and lands directly in the destination tensor),
exchanges them with ``batch_isend_irecv`` (or over the stateless group joining a disaggregated job's
trainers and engine ranks), copies its local slices, and yields the finished
vLLM tensors.
A destination tensor that is exactly one whole local parameter (e.g. a norm, or a row-parallel
weight when both TP sizes agree) is yielded as that parameter, without a copy. With equal TP
sizes and PP=1 nothing moves between ranks: each rank rewrites its own shard.
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Iterator

import torch
import torch.distributed as dist

from parallel.lora import merged_narrow
from parallel.names import global_param_names, is_expert_param
from parallel.pieces import ANY_TP_RANK, Piece, TargetLayout, TargetTensor, dest_region, piece_numel


@dataclass(frozen=True)
class RankInfo:
    """What one rank of the training world holds: coordinates (``etp``: expert-tensor-parallel
    rank, the TP coordinate of expert parameters), ``{global name: shape}`` and the names of its
    LoRA-adapted weights (``adapted``: sent merged, so never passed on as the live parameter)."""

    rank: int
    tp: int
    pp: int
    dp: int
    params: dict
    etp: int = 0
    adapted: frozenset = frozenset()

    def tp_of(self, name: str) -> int:
        """The TP coordinate of parameter ``name`` on this rank (expert parameters: ``etp``)."""
        return self.etp if is_expert_param(name) else self.tp


@dataclass
class Bucket:
    """This rank's share of one bucket of the plan."""

    tensors: list[TargetTensor]  # this rank's destination tensors, in target-layout order
    alias: dict[str, str]  # tensor name -> local parameter yielded as is
    local: list[tuple[str, Piece]]  # (tensor, piece) this rank copies from itself
    send: dict[int, list[Piece]]  # peer -> pieces packed (in order) into one buffer
    recv: dict[int, list[tuple[str, Piece]]]  # peer -> (tensor, piece) unpacked in order
    staged_bytes: int  # destination copies + send + receive buffers on this rank


@dataclass
class ReshardStats:
    """Measured by :meth:`Resharder.buckets`: bytes this rank sent and received, buckets and
    seconds spent (all cumulative), and the peak of bytes it staged at once (buffers +
    destination copies) during the latest sync."""

    sent_bytes: int = 0
    received_bytes: int = 0
    peak_staged_bytes: int = 0
    buckets: int = 0
    seconds: float = 0.0


class ReshardPlan:
    """The whole plan, the same on every rank, and this rank's buckets.

    Args:
        targets: the target layout: vLLM TP rank -> its :class:`TargetTensor` s.
        infos: every training rank's :class:`RankInfo` (index = rank: training ranks are ``0 .. len(infos) - 1``).
        vllm_tp: the engines' ``tensor_parallel_size`` (vLLM TP groups are consecutive destination
            ranks: the ``i``-th destination is vLLM TP rank ``i % vllm_tp``).
        rank: this rank. bucket_bytes: staging budget per bucket. element_size: bytes per element.
        destinations: the ranks that receive vLLM shards, in order; ``None``: every training rank
            (colocated engines). A disaggregated job's engines are ranks of their own
            (``len(infos) ..``): each piece then comes from one of its holders, the destinations
            taking turns over them, and training ranks only send.
    Raises:
        ValueError: sizes that do not divide (destinations vs ``vllm_tp``, heads), or a piece no rank holds.
    """

    def __init__(self, targets: TargetLayout, infos: list[RankInfo], vllm_tp: int, rank: int,
                 bucket_bytes: int, element_size: int, destinations: list[int] | None = None):
        dests = list(range(len(infos))) if destinations is None else list(destinations)
        if len(dests) % vllm_tp:
            raise ValueError(f"rollout.tensor_parallel_size={vllm_tp} must divide the {len(dests)} engine ranks")
        world = max(len(infos), max(dests) + 1)
        self.rank, self.world, self.vllm_tp, self.destinations = rank, world, vllm_tp, dests
        engine_index = {d: i for i, d in enumerate(dests)}
        engine_tp = {d: i % vllm_tp for d, i in engine_index.items()}
        per_rank = {r: targets(r) for r in range(vllm_tp)}
        holders: dict[tuple[str, int], list[RankInfo]] = defaultdict(list)
        for info in infos:
            for name in info.params:
                holders[(name, info.tp_of(name))].append(info)
                holders[(name, ANY_TP_RANK)].append(info)

        def source(piece: Piece, dst: int) -> int:
            cands = holders.get((piece.source, piece.source_tp_rank))
            if not cands:
                raise ValueError(f"no training rank holds {piece.source} (TP rank {piece.source_tp_rank})")
            if dst >= len(infos):  # an engine rank of its own: holders take turns
                return cands[engine_index[dst] % len(cands)].rank
            # the destination itself, else its own replica, else the nearest holder (spreads senders)
            return min(cands, key=lambda c: (c.rank != dst, c.dp != infos[dst].dp, abs(c.rank - dst), c.rank)).rank

        n = len(per_rank[0])
        # routes[i][dst] = [(src, piece)] for tensor i of destination dst
        routes = [{d: [(source(p, d), p) for p in per_rank[engine_tp[d]][i].pieces] for d in dests}
                  for i in range(n)]

        def aliased(i: int, d: int) -> str | None:
            t = per_rank[engine_tp[d]][i]
            if len(t.pieces) != 1 or routes[i][d][0][0] != d:
                return None
            p = t.pieces[0]
            if p.source in infos[d].adapted:  # W + scale B A: a new tensor, budgeted like a copy
                return None
            shape = tuple(infos[d].params[p.source])
            whole = not p.dest_index and p.source_start == 0 and p.dest_start == 0 and shape == t.shape \
                and p.length == shape[p.dim]
            return p.source if whole else None

        def costs(i: int) -> list[int]:
            """Bytes tensor ``i`` stages on each rank: its copy + what it sends + what it receives."""
            b = [0] * world
            for d in dests:
                shape = per_rank[engine_tp[d]][i].shape
                b[d] += 0 if aliased(i, d) else math.prod(shape)
                for src, p in routes[i][d]:
                    if src != d:
                        b[src] += piece_numel(shape, p)
                        b[d] += piece_numel(shape, p)
            return [v * element_size for v in b]

        cost = [costs(i) for i in range(n)]
        # Bucket boundaries: the same on every rank (the largest cost over ranks decides).
        bounds, start, acc = [], 0, 0
        for i in range(n):
            c = max(cost[i])
            if i > start and acc + c > bucket_bytes:
                bounds.append((start, i))
                start, acc = i, 0
            acc += c
        bounds.append((start, n))

        mine = per_rank[engine_tp[rank]] if rank in engine_tp else None  # None: this rank only sends
        self.buckets: list[Bucket] = []
        for lo, hi in bounds:
            b = Bucket([mine[i] for i in range(lo, hi)] if mine else [], {}, [], defaultdict(list),
                       defaultdict(list), 0)
            for i in range(lo, hi):
                if mine:
                    name = mine[i].name
                    if (src := aliased(i, rank)) is not None:
                        b.alias[name] = src
                    for src, p in routes[i][rank]:
                        if src == rank and name not in b.alias:
                            b.local.append((name, p))
                        elif src != rank:
                            b.recv[src].append((name, p))
                for d in dests:
                    if d != rank:
                        b.send[d] += [p for src, p in routes[i][d] if src == rank]
            b.send = {k: v for k, v in b.send.items() if v}
            b.staged_bytes = sum(cost[i][rank] for i in range(lo, hi))
            self.buckets.append(b)
        self.moves_data = any(b.send or b.recv for b in self.buckets)


def _chunks(model) -> list[torch.nn.Module]:
    return list(model) if isinstance(model, (list, tuple)) else [model]


def gather_rank_infos(model) -> list[RankInfo]:
    """Every rank's :class:`RankInfo` (collective over the default group); ``model`` is a shard
    or the list of a rank's virtual-pipeline chunks."""
    from megatron.core import parallel_state as ps

    mine = RankInfo(dist.get_rank(), ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank(),
                    ps.get_data_parallel_rank(),
                    {g: tuple(p.shape) for chunk in _chunks(model) for _, g, p in global_param_names(chunk)},
                    etp=ps.get_expert_tensor_parallel_rank(),
                    adapted=frozenset(g for chunk in _chunks(model) for _, g, p in global_param_names(chunk)
                                      if hasattr(p, "lora_adapter")))
    infos = [None] * dist.get_world_size()
    dist.all_gather_object(infos, mine)
    return infos


@dataclass
class Resharder:
    """Streams this rank's vLLM-layout tensors of ``model`` (a Megatron GPTModel shard, DDP or
    not, or the list of a rank's virtual-pipeline chunks: global layer names come from each
    layer's ``layer_number``, which Megatron offsets by pipeline stage and virtual stage).

    Build once per run (the plan is cached); call :meth:`buckets` after every optimizer step.
    ``targets``: the target layout (vLLM TP rank -> :class:`TargetTensor` s, e.g. a family
    bridge's ``vllm_layout``); ``vllm_tp``: the engines' TP size; ``bucket_bytes``: staging
    budget (at least the largest tensor is always allowed).

    ``group``: a disaggregated job's :class:`parallel.stateless_group.StatelessGroup` (trainers
    first, then the engine ranks): the plan then sends from the trainers (which pass their
    ``model`` and get empty buckets) to the engine ranks (which pass ``model=None`` and the
    parameters' ``dtype`` and ``device``), over that group. ``None``: colocated engines, every
    rank of the default group is both.
    """

    model: torch.nn.Module | None
    targets: TargetLayout
    vllm_tp: int = 1
    bucket_bytes: int = 64 << 20
    stats: ReshardStats = field(default_factory=ReshardStats)
    group: object = None
    dtype: torch.dtype | None = None
    device: torch.device | str = "cpu"

    def __post_init__(self):
        self._params = {} if self.model is None else \
            {g: p for chunk in _chunks(self.model) for _, g, p in global_param_names(chunk)}
        if self._params:
            first = next(iter(self._params.values()))
            self.dtype, self.device = first.dtype, first.device
        if self.group is None:
            infos, rank, destinations = gather_rank_infos(self.model), dist.get_rank(), None
        else:
            infos = self.group.broadcast_object(gather_rank_infos(self.model) if self.model is not None else None, 0)
            rank, destinations = self.group.rank, list(range(len(infos), self.group.size))
        self.plan = ReshardPlan(self.targets, infos, self.vllm_tp, rank, self.bucket_bytes,
                                torch.tensor([], dtype=self.dtype).element_size(), destinations)

    def _slice(self, piece: Piece) -> torch.Tensor:
        # a LoRA-adapted weight: W + scale * B A of just this piece (no merged copy of the model)
        return merged_narrow(self._params[piece.source], piece.dim, piece.source_start, piece.length)

    @torch.no_grad()
    def buckets(self) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Yield, bucket by bucket, ``[(vllm_name, tensor)]`` of this rank's vLLM TP shard
        (shapes as the target layout gives them, dtype of the parameters).

        Collective: every rank must consume every bucket in step. Tensors of a bucket are
        valid until the next one is requested (consume or copy them before); aliased ones are
        the live parameters: do not modify them.
        """
        t0, st = time.perf_counter(), self.stats
        st.peak_staged_bytes = 0
        for b in self.plan.buckets:
            out: dict[str, torch.Tensor] = {}
            for t in b.tensors:
                if t.name in b.alias:  # the live parameter (never a LoRA-adapted one: see ReshardPlan)
                    out[t.name] = self._params[b.alias[t.name]].detach()
                else:
                    out[t.name] = torch.zeros(t.shape, dtype=self.dtype, device=self._device())
            shapes = {t.name: t.shape for t in b.tensors}
            # One message per peer. A message of one row range (dim 0) is sent from / received into
            # the tensor itself (a contiguous view); others are packed into a staging buffer.
            send, recv, staged = {}, {}, 0
            for peer, pieces in b.send.items():
                direct = len(pieces) == 1 and pieces[0].dim == 0  # a row range of a parameter is contiguous
                send[peer] = self._slice(pieces[0]) if direct else torch.cat([self._slice(p).reshape(-1) for p in pieces])
                staged += 0 if direct else send[peer].numel()
            for peer, items in b.recv.items():
                (name, p), direct = items[0], len(items) == 1 and items[0][1].dim == 0
                recv[peer] = dest_region(out[name], p) if direct else torch.empty(
                    sum(piece_numel(shapes[n], q) for n, q in items), dtype=self.dtype, device=self._device())
                staged += 0 if direct else recv[peer].numel()
            finish = self._start_exchange(send, recv)
            for name, p in b.local:
                dest_region(out[name], p).copy_(self._slice(p))
            finish()
            for peer, items in b.recv.items():
                offset, buf = 0, recv[peer]
                if len(items) == 1 and items[0][1].dim == 0:
                    continue  # received in place
                for name, p in items:
                    region = dest_region(out[name], p)
                    k = region.numel()
                    region.copy_(buf[offset : offset + k].view(region.shape))
                    offset += k
            esize = torch.tensor([], dtype=self.dtype).element_size()
            staged += sum(out[t.name].numel() for t in b.tensors if t.name not in b.alias)
            st.peak_staged_bytes = max(st.peak_staged_bytes, staged * esize)
            st.sent_bytes += sum(v.numel() for v in send.values()) * esize
            st.received_bytes += sum(v.numel() for v in recv.values()) * esize
            st.buckets += 1
            del send, recv
            st.seconds += time.perf_counter() - t0
            yield [(t.name, out[t.name]) for t in b.tensors]
            t0 = time.perf_counter()
            del out

    def _start_exchange(self, send: dict[int, torch.Tensor], recv: dict[int, torch.Tensor]):
        """Start the bucket's transfers; returns the function that waits for them."""
        if self.group is not None:
            return self.group.start_exchange(send, recv)
        ops = [dist.P2POp(dist.isend, buf, peer) for peer, buf in send.items()]
        ops += [dist.P2POp(dist.irecv, buf, peer) for peer, buf in recv.items()]
        reqs = dist.batch_isend_irecv(ops) if ops else []
        return lambda: [r.wait() for r in reqs]

    def _device(self):
        return self.device
