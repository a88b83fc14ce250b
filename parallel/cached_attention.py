"""Attention of a few new queries against a KV cache (decoding), without copies per query head.

Pure torch, no Megatron: :class:`parallel.attention.ContextParallelAttention` decodes with it, and so does the
fixed-shape decode step (:mod:`alignment.rollout.engines.static_decode`), whose module ``megalign train``'s config checks
import without paying for Megatron's import.
"""

from __future__ import annotations

import torch


def cached_causal_attention(q, k, v, scale: float, mask=None):
    """Causal attention of the last ``sq`` positions of a sequence against all ``sk`` of its keys,
    as a KV cache gives them when decoding (megatron-core's inference engine): query ``i``
    (position ``sk - sq + i``) attends to keys ``0 .. sk - sq + i``. SDPA's ``is_causal``
    aligns the mask top-left, which would let a decoded token see only the first key.

    Two batched matmuls around an fp32 softmax, each group of query heads against its shared
    key/value head (GQA) without copying the keys and values per query head:
    - on CPU in fp32: for a few queries per sequence torch's CPU flash-attention kernel is slower
      (bf16, 32 rows x 9 heads x 1 query x 100 keys, one thread: 2.95 ms against 0.53 ms here)
      and rounds its probabilities to bf16 before multiplying by the values;
    - on GPU in the inputs' dtype (cuBLAS accumulates in fp32): SDPA's grouped-query path copies
      every key and value head once per query head (8B, 64 rows: ~100 us a layer and token on an
      H200, a third of the decode step).

    Args:
        q: ``[B, heads, sq, d]``; ``k``, ``v``: ``[B, kv_heads, sk, d]`` with ``sk >= sq``.
        mask: ``[sq, sk]`` bool, True where a query sees a key, instead of the bottom-right causal
            mask (a KV cache read past the sequence's end: :mod:`alignment.rollout.engines.static_decode`).
    Returns:
        ``[B, heads, sq, d]`` in ``q``'s dtype.
    """
    (b, heads, sq, d), (kv_heads, sk) = q.shape, k.shape[1:3]
    if mask is None:
        mask = torch.ones(sq, sk, dtype=torch.bool, device=q.device).tril(diagonal=sk - sq)
    group = heads // kv_heads  # query head h reads key/value head h // group (SDPA's enable_gqa)
    compute = torch.float32 if q.device.type == "cpu" else q.dtype
    scores = torch.matmul(q.reshape(b, kv_heads, group * sq, d).to(compute), k.to(compute).transpose(-1, -2))
    scores = (scores.float() * scale).view(b, kv_heads, group, sq, sk).masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1).view(b, kv_heads, group * sq, sk)
    return torch.matmul(probs.to(compute), v.to(compute)).view(b, heads, sq, d).to(q.dtype)
