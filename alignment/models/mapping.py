"""Declarative tensor mappings: the rows of a model family's table.

One row describes one Megatron-Core parameter completely, in every format megalign speaks:

* its HF checkpoint tensors (``hf``: name templates with ``{layer}`` and ``{expert}``), and how
  the ``rank``-th of ``size`` tensor-parallel shards is made from them and back
  (:meth:`Mapping.to_megatron`, :meth:`Mapping.to_hf`);
* the vLLM parameter it feeds (``vllm``: a name template, ``None`` if none) and, for vLLM TP rank
  ``r`` of ``t``, which rows/columns of which Megatron shards fill it
  (:meth:`Mapping.vllm_pieces`), following vLLM's own sharding rules;
* which of vLLM's weight loaders cuts that parameter from the HF tensors (``vllm_loader``), for
  the independent check (:mod:`alignment.rollout.engines.weight_check`).

Conversion, the resharder's target layout and the weight check all derive from the rows
(:class:`alignment.models.bridge.Bridge`), so a family's layout is written once. Which rank holds
which shard, and how shards travel, is :mod:`parallel`'s job.

Megatron layouts (``H`` hidden, ``hd`` head dim, ``nq``/``nkv`` query/KV heads, ``g = nq/nkv``):

* :class:`QKV` ``linear_qkv``: ``[nkv * (g + 2) * hd, H]``, interleaved per query group
  ``[q_0 .. q_{g-1}, k, v]``, so a contiguous split gives each TP rank whole groups.
* :class:`GatedMLP` ``linear_fc1``: each TP shard is ``[gate_r; up_r]``.
* :class:`Vocab`: vocabulary-parallel, padded to a multiple of
  ``make_vocab_size_divisible_by * tp`` with zero rows.
* :class:`RowParallel` (``linear_proj``, ``linear_fc2``): split along dim 1.
* :class:`Replicated`: the same tensor on every TP rank (norms, router, score head).
* :class:`VllmSplit`: replicated on the Megatron side (a vision tower, transformers' own module) but split
  over vLLM's TP ranks as vLLM's tower splits it.

vLLM's rules (``vllm/model_executor/layers/linear.py``, ``vocab_parallel_embedding.py``,
``fused_moe``), TP size ``t``, rank ``r``: ``QKVParallelLinear`` holds ``[q_r; k_r; v_r]`` with
KV heads replicated when ``t > nkv`` (rank ``r`` holds KV head ``r // (t / nkv)``);
``MergedColumnParallelLinear`` ``[gate_r; up_r]``; ``RowParallelLinear`` an even column split;
``VocabParallelEmbedding`` a vocabulary padded to 64 split evenly (zero padding rows); fused MoE
``w13`` ``[experts, 2 F/t, H]`` (``[gate_r; up_r]`` per expert) and ``w2`` ``[experts, H, F/t]``.

Sources: Megatron-Bridge ``models/conversion/param_mapping.py`` (``AutoMapping``, ``QKVMapping``,
``GatedMLPMapping``), Megatron-LM ``tools/checkpoint``, vLLM 0.32's layers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from alignment.models.dims import ModelDims
from parallel.pieces import ANY_TP_RANK, Piece, even_pieces, merge_runs

Tensor = torch.Tensor
Shape = Callable[[ModelDims], tuple[int, ...]]

VLLM_VOCAB_PADDING = 64  # vllm DEFAULT_VOCAB_PADDING_SIZE


def vllm_padded_vocab(vocab_size: int) -> int:
    """vLLM's padded vocabulary (``pad_vocab_size``: a multiple of 64)."""
    return -(-vocab_size // VLLM_VOCAB_PADDING) * VLLM_VOCAB_PADDING


@dataclass(frozen=True)
class Mapping:
    """One Megatron parameter and its HF / vLLM counterparts (see the module doc).

    Args:
        megatron: Megatron name, relative to ``decoder.layers.{layer}.`` for layer rows, global
            otherwise; expert rows contain ``{expert}``.
        hf: HF checkpoint name templates of the tensors it is made of.
        vllm: vLLM parameter name template, or None when the engine has no such parameter.
        expert: one row per expert (``{expert}`` = global expert index): split over the
            expert-tensor-parallel group; the vLLM parameter stacks all experts on dim 0.
    """

    megatron: str
    hf: tuple[str, ...]
    vllm: str | None = None
    expert: bool = False

    vllm_loader = "replicated"

    def to_megatron(self, srcs: list[Tensor], rank: int, size: int, d: ModelDims) -> Tensor:
        """The ``rank``-th of ``size`` TP shards from the HF tensors ``srcs`` (in ``hf`` order)."""
        raise NotImplementedError

    def to_hf(self, shards: list[Tensor], d: ModelDims) -> list[Tensor]:
        """The HF tensors (in ``hf`` order) from all TP shards, ordered by TP rank."""
        raise NotImplementedError

    def vllm_pieces(self, source: str, d: ModelDims, s: int, t: int, r: int) -> tuple[tuple[int, ...], list[Piece]]:
        """Shape of the vLLM parameter on vLLM TP rank ``r`` of ``t`` (one expert's slice for
        expert rows) and the pieces of Megatron parameter ``source`` (split over ``s`` ranks)
        that fill it."""
        raise NotImplementedError


@dataclass(frozen=True)
class Replicated(Mapping):
    """The same tensor on every TP rank (and every vLLM rank): norms, the MoE router, the score head.
    ``shape``: the tensor's shape from the dims."""

    shape: Shape = lambda d: (d.hidden_size,)  # noqa: E731

    def to_megatron(self, srcs, rank, size, d):
        return srcs[0]

    def to_hf(self, shards, d):
        return [shards[0]]

    def vllm_pieces(self, source, d, s, t, r):
        shape = self.shape(d)
        return shape, [Piece(source, ANY_TP_RANK, 0, 0, 0, shape[0])]


@dataclass(frozen=True)
class VllmSplit(Replicated):
    """A tensor replicated on every Megatron TP rank (a vision tower's: transformers' own module) that
    vLLM splits over its TP ranks, as its vision towers' layers do (``vllm/model_executor/models/
    qwen2_5_vl.py``, ``qwen3_vl.py``): ``dim=0`` a ``ColumnParallelLinear`` (weight ``[out, in]`` or
    bias ``[out]``; ``parts=3``: a ``QKVParallelLinear`` of a checkpoint-fused ``[q; k; v]``, each
    third split, rank ``r`` holding ``[q_r; k_r; v_r]``); ``dim=1`` a ``RowParallelLinear`` weight
    (its bias is whole on every rank: :class:`Replicated`); ``half=0 / 1``: the gate / up part of a
    ``MergedColumnParallelLinear`` that two rows fill (rank ``r`` holds ``[gate_r; up_r]``).
    ``shape``: the full tensor's shape from the dims."""

    dim: int = 0
    parts: int = 1
    half: int | None = None

    @property
    def vllm_loader(self) -> str:
        if self.dim == 1:
            return "row"
        if self.half is not None:
            return "merged"
        return "qkv_fused" if self.parts == 3 else "column"

    def split_size(self, d: ModelDims) -> int:
        """The length vLLM's TP size must divide (one part's rows, or the columns)."""
        shape = self.shape(d)
        return shape[1] if self.dim == 1 else shape[0] // self.parts

    def vllm_pieces(self, source, d, s, t, r):
        shape = self.shape(d)
        if self.dim == 1:
            per = shape[1] // t
            return (shape[0], per, *shape[2:]), [Piece(source, ANY_TP_RANK, 1, r * per, 0, per)]
        per = self.split_size(d) // t
        if self.half is not None:
            return (2 * per, *shape[1:]), [Piece(source, ANY_TP_RANK, 0, r * per, self.half * per, per)]
        part = shape[0] // self.parts
        return (self.parts * per, *shape[1:]), [Piece(source, ANY_TP_RANK, 0, p * part + r * per, p * per, per)
                                                for p in range(self.parts)]


@dataclass(frozen=True)
class RowParallel(Mapping):
    """Split along the input dimension (dim 1): ``linear_proj`` / ``o_proj``, ``linear_fc2`` /
    ``down_proj`` (vLLM ``RowParallelLinear``; for experts, fused MoE ``w2``).
    ``shape``: the full ``[out, in]`` shape from the dims."""

    shape: Shape = lambda d: (d.hidden_size, d.ffn_hidden_size)  # noqa: E731

    @property
    def vllm_loader(self) -> str:
        return "moe_w2" if self.expert else "row"

    def to_megatron(self, srcs, rank, size, d):
        return srcs[0].chunk(size, dim=1)[rank]

    def to_hf(self, shards, d):
        return [torch.cat(shards, dim=1)]

    def vllm_pieces(self, source, d, s, t, r):
        rows, cols = self.shape(d)
        per = cols // t
        return (rows, per), list(merge_runs(even_pieces(source, 1, r * per, (r + 1) * per, cols // s, 0)))


@dataclass(frozen=True)
class Vocab(Mapping):
    """Vocabulary-parallel ``[vocab, H]``: word embeddings and the LM head (vLLM
    ``VocabParallelEmbedding`` / ``ParallelLMHead``)."""

    vllm_loader = "vocab"

    def to_megatron(self, srcs, rank, size, d):
        w = srcs[0]
        pad = d.padded_vocab_size(size) - w.shape[0]
        if pad:
            w = torch.cat([w, w.new_zeros(pad, w.shape[1])])
        return w.chunk(size, dim=0)[rank]

    def to_hf(self, shards, d):
        return [torch.cat(shards, dim=0)[: d.vocab_size]]

    def vllm_pieces(self, source, d, s, t, r):
        per = vllm_padded_vocab(d.vocab_size) // t
        lo, hi = r * per, min((r + 1) * per, d.vocab_size)
        chunk = d.padded_vocab_size(s) // s
        return (per, d.hidden_size), even_pieces(source, 0, lo, hi, chunk, 0) if hi > lo else []


@dataclass(frozen=True)
class QKV(Mapping):
    """Fused ``linear_qkv`` (weight ``[rows, H]`` or bias ``[rows]``) from ``hf = (q, k, v)``:
    Megatron interleaves per query group; vLLM's ``QKVParallelLinear`` holds ``[q_r; k_r; v_r]``."""

    vllm_loader = "qkv"

    def to_megatron(self, srcs, rank, size, d):
        q, k, v = srcs
        nkv, g, hd, rest = d.num_query_groups, d.num_attention_heads // d.num_query_groups, d.head_dim, q.shape[1:]
        fused = torch.cat([q.reshape(nkv, g * hd, *rest), k.reshape(nkv, hd, *rest), v.reshape(nkv, hd, *rest)], dim=1)
        return fused.chunk(size, dim=0)[rank].reshape(-1, *rest)

    def to_hf(self, shards, d):
        nkv, hd, rest = d.num_query_groups, d.head_dim, shards[0].shape[1:]
        g = d.num_attention_heads // nkv
        fused = torch.cat(shards, dim=0).reshape(nkv, (g + 2) * hd, *rest)
        q, k, v = fused.split([g * hd, hd, hd], dim=1)
        return [q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)]

    def vllm_pieces(self, source, d, s, t, r):
        nq, nkv, hd = d.num_attention_heads, d.num_query_groups, d.head_dim
        g, groups_per_src, block = nq // nkv, nkv // s, (nq // nkv + 2) * hd
        pieces = []

        def head(group: int, offset_in_block: int, dest: int) -> None:
            j, k = divmod(group, groups_per_src)
            pieces.append(Piece(source, j, 0, k * block + offset_in_block, dest, hd))

        q_heads = nq // t
        for i, h in enumerate(range(r * q_heads, (r + 1) * q_heads)):
            head(h // g, (h % g) * hd, i * hd)
        kv = [r // (t // nkv)] if t >= nkv else list(range(r * nkv // t, (r + 1) * nkv // t))
        base = q_heads * hd
        for i, k in enumerate(kv):
            head(k, g * hd, base + i * hd)
        base += len(kv) * hd
        for i, k in enumerate(kv):
            head(k, (g + 1) * hd, base + i * hd)
        rows = base + len(kv) * hd
        shape = (rows,) if self.megatron.endswith("bias") else (rows, d.hidden_size)
        return shape, list(merge_runs(pieces))


@dataclass(frozen=True)
class GatedMLP(Mapping):
    """Fused ``linear_fc1`` ``[gate_r; up_r]`` from ``hf = (gate, up)`` (vLLM
    ``MergedColumnParallelLinear``; for experts, fused MoE ``w13``). ``ffn``: the MLP width."""

    ffn: Callable[[ModelDims], int] = lambda d: d.ffn_hidden_size  # noqa: E731

    @property
    def vllm_loader(self) -> str:
        return "moe_w13" if self.expert else "merged"

    def to_megatron(self, srcs, rank, size, d):
        gate, up = srcs
        return torch.cat([gate.chunk(size, 0)[rank], up.chunk(size, 0)[rank]])

    def to_hf(self, shards, d):
        halves = [x.chunk(2, dim=0) for x in shards]
        return [torch.cat([a for a, _ in halves]), torch.cat([b for _, b in halves])]

    def vllm_pieces(self, source, d, s, t, r):
        f = self.ffn(d)
        f_t, f_s = f // t, f // s
        gate = even_pieces(source, 0, r * f_t, (r + 1) * f_t, f_s, 0)
        up = even_pieces(source, 0, r * f_t, (r + 1) * f_t, f_s, f_t, source_offset=f_s)
        return (2 * f_t, d.hidden_size), list(merge_runs(gate + up))


def hidden(d: ModelDims) -> tuple[int, ...]:
    return (d.hidden_size,)


def head_dim(d: ModelDims) -> tuple[int, ...]:
    return (d.head_dim,)


# The tensors outside the layers, the same in every GPT family of HF transformers.
EMBEDDING = Vocab("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), "model.embed_tokens.weight")
FINAL_NORM = Replicated("decoder.final_layernorm.weight", ("model.norm.weight",), "model.norm.weight", shape=hidden)
LM_HEAD = Vocab("output_layer.weight", ("lm_head.weight",), "lm_head.weight")
# HF ``*ForSequenceClassification`` with ``num_labels=1``: megalign's scalar reward / value head
SCORE_HEAD = Replicated("output_layer.weight", ("score.weight",), None, shape=lambda d: (1, d.hidden_size))


@dataclass(frozen=True)
class Family:
    """A model family: the HF causal-LM architectures it covers (each also accepted as its
    ``*ForSequenceClassification`` twin for reward models and critics), how to read its
    :class:`ModelDims` from an HF config (raising ValueError, naming the HF field, for what it
    cannot run), and its table: the rows of layer ``i`` (Megatron names relative to the layer).
    ``extra``: the rows outside the language model (a vision tower's; global Megatron names).
    ``causal_lm``: the architectures are causal LMs with a ``*ForSequenceClassification`` twin
    (False for vision-language models: ``*ForConditionalGeneration``, no reward-model form);
    ``vision``: a vision-language family's :class:`alignment.models.vlm.VisionSpec`;
    ``hf_language_model``: the prefix of the language model's tensors in the family's checkpoints
    (the table's rows say ``model.``; Qwen3-VL's checkpoints say ``model.language_model.``).
    ``vllm_language_model``: the prefix of the language model's parameters in the family's vLLM model
    (vLLM's vision-language models hold it as ``language_model``: ``language_model.model.layers.*``).
    ``fused_experts``: a :class:`alignment.models.fused_experts.FusedExperts` when the family's checkpoints store
    each MoE layer's experts in one tensor (the table's rows name them per expert, as Qwen3-MoE's checkpoints do).
    ``vllm_hf_overrides``: config fields the family's vLLM model needs that its HF config may lack (vLLM's
    ``hf_overrides``, nested per sub-config).
    One folder per family under ``alignment/models/`` holds one of these."""

    name: str
    architectures: tuple[str, ...]
    dims: Callable[[object], ModelDims]
    layer: Callable[[ModelDims, int], tuple[Mapping, ...]]
    extra: Callable[[ModelDims], tuple[Mapping, ...]] = lambda d: ()  # noqa: E731
    causal_lm: bool = True
    vision: object = None
    hf_language_model: str = "model."
    vllm_language_model: str = ""
    fused_experts: object = None
    vllm_hf_overrides: object = None
