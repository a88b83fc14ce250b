"""Target tensors as pieces of Megatron tensor-parallel shards: the vocabulary the resharder
(:mod:`parallel.reshard`) moves data with. Pure geometry, no model knowledge and no
communication: which target tensors exist and how each is cut is a model family's table
(``alignment/models/<family>/``); this module only says what a piece is, how to cut an evenly
split tensor into pieces, and how to assemble a target from shards in one process.

A :class:`TargetTensor` is one tensor of the destination layout (e.g. one vLLM parameter on one
vLLM tensor-parallel rank); each :class:`Piece` copies ``length`` rows (``dim=0``) or columns
(``dim=1``) of one Megatron shard into it, optionally into a sub-tensor selected by leading
indices (``dest_index``, e.g. expert ``e`` of a fused ``[experts, rows, cols]`` MoE weight).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import math

import torch

ANY_TP_RANK = -1  # a replicated Megatron parameter: every TP rank holds the same tensor


@dataclass(frozen=True)
class Piece:
    """``length`` rows (``dim=0``) or columns (``dim=1``) starting at ``source_start`` of
    Megatron parameter ``source`` (global name) on TP rank ``source_tp_rank`` go to
    ``dest_start`` of the target tensor's sub-tensor ``target[dest_index]``.

    ``source_tp_rank`` is the rank in the group the parameter is split over: the tensor-parallel
    group for dense parameters, the expert-tensor-parallel group for expert parameters;
    ``ANY_TP_RANK`` when the parameter is replicated over it."""

    source: str
    source_tp_rank: int
    dim: int
    source_start: int
    dest_start: int
    length: int
    dest_index: tuple[int, ...] = ()


@dataclass(frozen=True)
class TargetTensor:
    """One tensor of the destination layout: its name, shape, and the pieces that fill it
    (elements no piece covers, e.g. vocabulary padding, are zero)."""

    name: str
    shape: tuple[int, ...]
    pieces: tuple[Piece, ...]


TargetLayout = Callable[[int], list[TargetTensor]]
"""Destination rank (e.g. vLLM TP rank) -> its target tensors, in the order they are consumed."""


def piece_numel(shape: tuple[int, ...], piece: Piece) -> int:
    """Elements ``piece`` fills in a target tensor of ``shape``."""
    sub = shape[len(piece.dest_index):]
    return piece.length * math.prod(s for i, s in enumerate(sub) if i != piece.dim)


def dest_region(target: torch.Tensor, piece: Piece) -> torch.Tensor:
    """The view of ``target`` (a tensor of the target's shape) that ``piece`` fills."""
    sub = target[piece.dest_index] if piece.dest_index else target
    return sub.narrow(piece.dim, piece.dest_start, piece.length)


def merge_runs(pieces: list[Piece]) -> tuple[Piece, ...]:
    """Merge consecutive pieces that continue each other on both sides (fewer, larger copies)."""
    out: list[Piece] = []
    for p in pieces:
        q = out[-1] if out else None
        if q and (q.source, q.source_tp_rank, q.dim, q.dest_index) == (p.source, p.source_tp_rank, p.dim,
                                                                      p.dest_index) \
                and q.source_start + q.length == p.source_start and q.dest_start + q.length == p.dest_start:
            out[-1] = Piece(q.source, q.source_tp_rank, q.dim, q.source_start, q.dest_start, q.length + p.length,
                            q.dest_index)
        else:
            out.append(p)
    return tuple(out)


def even_pieces(source: str, dim: int, global_start: int, global_end: int, chunk: int, dest_start: int,
                source_offset: int = 0, dest_index: tuple[int, ...] = ()) -> list[Piece]:
    """Pieces for global rows ``[global_start, global_end)`` of a tensor split evenly into
    ``chunk``-sized shards over the TP ranks (``source_offset``: where the split tensor starts
    inside each shard, e.g. ``up`` after ``gate`` in a fused ``[gate_j; up_j]`` shard)."""
    out, g = [], global_start
    while g < global_end:
        j, off = divmod(g, chunk)
        n = min(chunk - off, global_end - g)
        out.append(Piece(source, j, dim, source_offset + off, dest_start + g - global_start, n, dest_index))
        g += n
    return out


def assemble(tensor: TargetTensor, shard: Callable[[str, int], torch.Tensor]) -> torch.Tensor:
    """Build one target tensor from Megatron shards in one process: ``shard(name, tp_rank)``
    returns a Megatron parameter's TP shard (``tp_rank=ANY_TP_RANK`` for replicated ones).
    Elements no piece covers are zero. For tests and single-process tools; training uses
    :class:`parallel.reshard.Resharder`, which moves only the pieces."""
    out = None
    for p in tensor.pieces:
        src = shard(p.source, p.source_tp_rank)
        if out is None:
            out = src.new_zeros(tensor.shape)
        dest_region(out, p).copy_(src.narrow(p.dim, p.source_start, p.length))
    return out if out is not None else torch.zeros(tensor.shape)
