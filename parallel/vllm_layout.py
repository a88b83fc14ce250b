"""Format mapping from Megatron-Core tensor-parallel shards to vLLM's tensor-parallel layout
(Llama / Mistral / SmolLM2 / Qwen2): which rows or columns of which Megatron shard make up
each vLLM parameter on each vLLM TP rank. Pure geometry, no communication and no tensors:
moving the data is :mod:`parallel.reshard`'s job.

vLLM's rules (``vllm/model_executor/layers/linear.py``, ``vocab_parallel_embedding.py``), for
vLLM TP size ``t``, rank ``r``, ``nq`` query heads, ``nkv`` KV heads, head dim ``hd``:

* ``qkv_proj`` (``QKVParallelLinear``): ``[q_r; k_r; v_r]``, ``q_r`` = query heads
  ``[r*nq/t, (r+1)*nq/t)``; KV heads split the same way, or, when ``t > nkv``, replicated: rank
  ``r`` holds KV head ``r // (t/nkv)``. The bias (Qwen2) follows the same rows.
* ``gate_up_proj`` (``MergedColumnParallelLinear``): ``[gate_r; up_r]``, each an even row split.
* ``o_proj`` / ``down_proj`` (``RowParallelLinear``): even split of the columns.
* ``embed_tokens`` / ``lm_head`` (``VocabParallelEmbedding``): vocabulary padded to a multiple of
  64, split evenly; padding rows are zero. Norms are replicated.

Megatron's side (``alignment.models.bridges.llama``): ``linear_qkv`` interleaved per query
group ``[q_0..q_{g-1}, k, v]`` with whole groups per TP rank; ``linear_fc1`` per rank
``[gate_j; up_j]``; vocabulary padded to a multiple of ``128 * tp``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from alignment.models.bridges.llama import LlamaDims

VLLM_VOCAB_PADDING = 64  # vllm DEFAULT_VOCAB_PADDING_SIZE
ANY_TP_RANK = -1  # a replicated Megatron parameter: every TP rank holds the same tensor


@dataclass(frozen=True)
class Piece:
    """``length`` rows (``dim=0``) or columns (``dim=1``) starting at ``source_start`` of
    Megatron parameter ``source`` on TP rank ``source_tp_rank`` go to ``dest_start`` of the
    vLLM tensor. ``source_tp_rank=ANY_TP_RANK``: the parameter is replicated over TP."""

    source: str
    source_tp_rank: int
    dim: int
    source_start: int
    dest_start: int
    length: int


@dataclass(frozen=True)
class VLLMTensor:
    """One vLLM parameter on one vLLM TP rank: its name, shape, and the pieces that fill it
    (rows not covered by any piece, i.e. vocabulary padding, are zero)."""

    name: str
    shape: tuple[int, ...]
    pieces: tuple[Piece, ...]


def _runs(pieces: list[Piece]) -> tuple[Piece, ...]:
    """Merge consecutive pieces that continue each other on both sides (fewer, larger copies)."""
    out: list[Piece] = []
    for p in pieces:
        q = out[-1] if out else None
        if q and (q.source, q.source_tp_rank, q.dim) == (p.source, p.source_tp_rank, p.dim) \
                and q.source_start + q.length == p.source_start and q.dest_start + q.length == p.dest_start:
            out[-1] = Piece(q.source, q.source_tp_rank, q.dim, q.source_start, q.dest_start, q.length + p.length)
        else:
            out.append(p)
    return tuple(out)


def _even(source: str, dim: int, global_start: int, global_end: int, chunk: int, dest_start: int,
          source_offset: int = 0) -> list[Piece]:
    """Pieces for global rows ``[global_start, global_end)`` of a tensor split evenly into
    ``chunk``-sized shards over the Megatron TP ranks (``source_offset``: where the split tensor
    starts inside each shard, e.g. ``up`` after ``gate`` in ``linear_fc1``)."""
    out, g = [], global_start
    while g < global_end:
        j, off = divmod(g, chunk)
        n = min(chunk - off, global_end - g)
        out.append(Piece(source, j, dim, source_offset + off, dest_start + g - global_start, n))
        g += n
    return out


def vllm_padded_vocab(vocab_size: int) -> int:
    """vLLM's padded vocabulary (``pad_vocab_size``: a multiple of 64)."""
    return -(-vocab_size // VLLM_VOCAB_PADDING) * VLLM_VOCAB_PADDING


def check_tp_sizes(dims: LlamaDims, megatron_tp: int, vllm_tp: int) -> None:
    """Raise ValueError, naming the field, for TP sizes either side cannot use."""
    nq, nkv = dims.num_attention_heads, dims.num_query_groups
    if nq % megatron_tp or nkv % megatron_tp or dims.ffn_hidden_size % megatron_tp:
        raise ValueError(f"parallel.tensor_model_parallel_size={megatron_tp} must divide the attention heads ({nq}), "
                         f"KV heads ({nkv}) and MLP size ({dims.ffn_hidden_size})")
    if nq % vllm_tp or dims.ffn_hidden_size % vllm_tp or (nkv % vllm_tp and vllm_tp % nkv) \
            or vllm_padded_vocab(dims.vocab_size) % vllm_tp:
        raise ValueError(f"rollout.tensor_parallel_size={vllm_tp} must divide the attention heads ({nq}), the MLP size "
                         f"({dims.ffn_hidden_size}) and the padded vocabulary, and divide or be a multiple of the KV "
                         f"heads ({nkv})")


def vllm_tensors(dims: LlamaDims, megatron_tp: int, vllm_tp: int, vllm_rank: int,
                 qkv_bias: bool = False) -> list[VLLMTensor]:
    """Every vLLM parameter of vLLM TP rank ``vllm_rank`` (of ``vllm_tp``), in vLLM's
    ``named_parameters`` order, with the Megatron pieces (global layer names) that fill it.

    A tied LM head is not listed (vLLM ties ``lm_head`` to ``embed_tokens``).
    Raises:
        ValueError: TP sizes that do not divide the model (see :func:`check_tp_sizes`).
    """
    check_tp_sizes(dims, megatron_tp, vllm_tp)
    d, s, t, r = dims, megatron_tp, vllm_tp, vllm_rank
    H, hd, nq, nkv, F = d.hidden_size, d.head_dim, d.num_attention_heads, d.num_query_groups, d.ffn_hidden_size
    g = nq // nkv
    out: list[VLLMTensor] = []

    def vocab(name: str, source: str) -> VLLMTensor:
        per = vllm_padded_vocab(d.vocab_size) // t
        lo, hi = r * per, min((r + 1) * per, d.vocab_size)
        chunk = d.padded_vocab_size(s) // s
        return VLLMTensor(name, (per, H), tuple(_even(source, 0, lo, hi, chunk, 0)) if hi > lo else ())

    def replicated(name: str, source: str, shape: tuple[int, ...]) -> VLLMTensor:
        return VLLMTensor(name, shape, (Piece(source, ANY_TP_RANK, 0, 0, 0, shape[0]),))

    def qkv_rows(source: str) -> tuple[tuple[Piece, ...], int]:
        """Pieces of ``[q_r; k_r; v_r]`` (weight rows or bias elements) and its row count."""
        groups_per_src = nkv // s
        block = (g + 2) * hd  # rows of one query group in Megatron's interleaved layout
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
        return _runs(pieces), base + len(kv) * hd

    out.append(vocab("model.embed_tokens.weight", "embedding.word_embeddings.weight"))
    for layer in range(d.num_layers):
        m, v = f"decoder.layers.{layer}.", f"model.layers.{layer}."
        out.append(replicated(v + "input_layernorm.weight", m + "input_layernorm.weight", (H,)))
        pieces, rows = qkv_rows(m + "self_attention.linear_qkv.weight")
        out.append(VLLMTensor(v + "self_attn.qkv_proj.weight", (rows, H), pieces))
        if qkv_bias:
            pieces, rows = qkv_rows(m + "self_attention.linear_qkv.bias")
            out.append(VLLMTensor(v + "self_attn.qkv_proj.bias", (rows,), pieces))
        cols = nq * hd // t
        out.append(VLLMTensor(v + "self_attn.o_proj.weight", (H, cols), _runs(
            _even(m + "self_attention.linear_proj.weight", 1, r * cols, (r + 1) * cols, nq * hd // s, 0))))
        out.append(replicated(v + "post_attention_layernorm.weight", m + "pre_mlp_layernorm.weight", (H,)))
        f_t, f_s, fc1 = F // t, F // s, m + "mlp.linear_fc1.weight"
        gate = _even(fc1, 0, r * f_t, (r + 1) * f_t, f_s, 0)
        up = _even(fc1, 0, r * f_t, (r + 1) * f_t, f_s, f_t, source_offset=f_s)
        out.append(VLLMTensor(v + "mlp.gate_up_proj.weight", (2 * f_t, H), _runs(gate + up)))
        out.append(VLLMTensor(v + "mlp.down_proj.weight", (H, f_t), _runs(
            _even(m + "mlp.linear_fc2.weight", 1, r * f_t, (r + 1) * f_t, f_s, 0))))
    out.append(replicated("model.norm.weight", "decoder.final_layernorm.weight", (H,)))
    if not d.tie_word_embeddings:
        out.append(vocab("lm_head.weight", "output_layer.weight"))
    return out


def assemble(tensor: VLLMTensor, shard: Callable[[str, int], torch.Tensor]) -> torch.Tensor:
    """Build one vLLM tensor from Megatron shards in one process: ``shard(name, tp_rank)`` returns
    a Megatron parameter's TP shard (``tp_rank=ANY_TP_RANK`` for replicated ones). Rows no piece
    covers (vocabulary padding) are zero. For tests and single-process tools; training
    uses :class:`parallel.reshard.Resharder`, which moves only the pieces."""
    out = None
    for p in tensor.pieces:
        src = shard(p.source, p.source_tp_rank)
        if out is None:
            out = src.new_zeros(tensor.shape)
        out.narrow(p.dim, p.dest_start, p.length).copy_(src.narrow(p.dim, p.source_start, p.length))
    return out if out is not None else torch.zeros(tensor.shape)
