"""megalign's core attention for Megatron-Core's layer spec: causal attention for padded
(``sbhd``) and packed (``thd``, :class:`megatron.core.packed_seq_params.PackedSeqParams`)
input, with context parallelism by ring (``cp_comm_type="p2p"``) or Ulysses all-to-all
(``"a2a"``).

Megatron-Core 0.16.1's own local ``DotProductAttention`` refuses ``context_parallel_size > 1``
and packed input; transformer-engine's ``TEDotProductAttention`` does both, on GPU. This
module takes the place of ``DotProductAttention`` in the local spec
(:func:`alignment.models.gpt.build_gpt_model`), so CP, Ulysses and packing run everywhere.
Same constructor and ``forward`` contract as ``DotProductAttention``.
"""

from __future__ import annotations

import math

from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule

from parallel.cached_attention import cached_causal_attention
from parallel.context_parallel import ring_attention
from parallel.ulysses import FLASH_DTYPES, causal_attention, sdpa_backends, ulysses_attention, varlen_causal_attention

CP_COMM_TYPES = ("p2p", "a2a")


def tree_attention(query, key, value, cu_seqlens, tree_masks, scale: float, segments=None):
    """Attention of packed prompt trees (:mod:`parallel.prompt_tree`): ``query`` ``[t, heads, d]``,
    ``key``/``value`` ``[t, kv_heads, d]``; the tree between ``cu_seqlens[k]`` and
    ``cu_seqlens[k + 1]`` attends by ``tree_masks[k]`` (bool, True: may attend). Returns
    ``[t, heads, d]``.

    On CUDA with ``segments`` (:class:`parallel.prompt_tree.TreeSegments`, the same attention as
    causal segments) it is one FlashAttention varlen call over the segments, each response's
    keys gathered as its prompt's followed by its own: it costs what causal attention over each
    row would, and keeps no attention weights. SDPA with a tree mask instead runs its
    memory-efficient kernel over every (query, key) pair of the tree (measured on an H100,
    TinyLlama-1.1B shape, 8 x 8 rows of up to 1,400 tokens: 1.5 s of the 2.7 s training step,
    against 0.12 s for plain packed rows) and, with ``enable_gqa``, only its math kernel, which
    keeps ``[heads, n, n]`` weights per layer (4 GiB a layer there: out of memory at 22 layers).
    Elsewhere (CPU; fp32, which FlashAttention does not take) SDPA with the masks.
    """
    import torch
    import torch.nn.functional as F

    if query.is_cuda and segments is not None and query.dtype in FLASH_DTYPES:

        k, v = key[segments.key_index], value[segments.key_index]
        return varlen_causal_attention(query, k, v, segments.cu_seqlens_q, segments.cu_seqlens_kv,
                                       segments.max_seqlen_q, segments.max_seqlen_kv, scale)
    q, k, v = (x.permute(1, 0, 2).unsqueeze(0) for x in (query, key, value))  # [1, h, t, d]
    gqa = q.shape[1] != k.shape[1]
    if gqa and q.is_cuda:  # the memory-efficient kernel takes a mask but not enable_gqa
        k, v = (x.repeat_interleave(q.shape[1] // x.shape[1], dim=1) for x in (k, v))
        gqa = False
    bounds = cu_seqlens.tolist()
    with sdpa_backends(q):
        outs = [F.scaled_dot_product_attention(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], attn_mask=mask,
                                               scale=scale, enable_gqa=gqa)
                for a, b, mask in zip(bounds[:-1], bounds[1:], tree_masks)]
    return torch.cat(outs, dim=2).squeeze(0).permute(1, 0, 2)


class ContextParallelAttention(MegatronModule):
    """Causal self-attention over whole sequences whose tokens may be spread over the
    context-parallel group (zig-zag layout, :mod:`parallel.context_parallel`).

    Raises:
        ValueError: a non-causal mask type, attention dropout, or an unknown ``cp_comm_type``.
    """

    def __init__(self, config, layer_number: int, attn_mask_type, attention_type: str,
                 attention_dropout: float | None = None, softmax_scale: float | None = None,
                 cp_comm_type: str | None = None, pg_collection=None):
        super().__init__(config=config)
        from megatron.core import parallel_state as ps

        if attn_mask_type not in (AttnMaskType.causal, AttnMaskType.padding_causal):
            raise ValueError(f"ContextParallelAttention is causal only (got attn_mask_type={attn_mask_type})")
        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        if dropout:
            raise ValueError(f"attention_dropout={dropout}: megalign's attention has no dropout; set it to 0")
        self.cp_comm_type = cp_comm_type or config.cp_comm_type or "p2p"
        if self.cp_comm_type not in CP_COMM_TYPES:
            raise ValueError(f"parallel.cp_comm_type={self.cp_comm_type!r}: valid values are {CP_COMM_TYPES} "
                             "(ring attention, Ulysses all-to-all)")
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(config.kv_channels)
        cp = getattr(pg_collection, "cp", None) if pg_collection is not None else None
        self.cp_group = cp if cp is not None else ps.get_context_parallel_group()

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        """``query`` ``[s, b, heads, d]`` (``[t, heads, d]`` packed), ``key``/``value`` with
        ``kv_heads``; returns ``[s, b, heads * d]`` (``[t, heads, d]`` packed). ``s``/``t`` are
        this CP rank's tokens. Packed sequences are delimited by ``cu_seqlens_q_padded``
        (global lengths, multiples of ``2 * cp``), else ``cu_seqlens_q``; a packed prompt tree
        (``packed_seq_params.tree_masks``, :mod:`parallel.prompt_tree`) attends by its masks."""
        if attention_mask is not None or attention_bias is not None:
            raise ValueError("ContextParallelAttention takes no attention_mask/bias: it is causal per sequence")
        cp = self.cp_group.size()
        tree_masks = getattr(packed_seq_params, "tree_masks", None)
        if tree_masks is not None:  # prompts and their responses (parallel.prompt_tree)
            if cp > 1:
                raise ValueError("shared-prompt packing (parallel.prompt_tree) does not run with "
                                 "context_parallel_size > 1: a tree's attention mask spans the whole tree")
            return tree_attention(query, key, value, packed_seq_params.cu_seqlens_q, tree_masks, self.softmax_scale,
                                  getattr(packed_seq_params, "tree_segments", None))
        packed = packed_seq_params is not None and packed_seq_params.qkv_format == "thd"
        if not packed and cp == 1 and key.shape[0] != query.shape[0]:  # decoding against a KV cache
            q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, h, s, d]
            out = cached_causal_attention(q, k, v, self.softmax_scale)
            return out.permute(2, 0, 1, 3).reshape(out.shape[2], out.shape[0], -1)
        if packed:
            cu = packed_seq_params.cu_seqlens_q_padded
            cu = packed_seq_params.cu_seqlens_q if cu is None else cu
            global_lens = (cu[1:] - cu[:-1]).tolist()
            q, k, v = (t.permute(1, 0, 2).unsqueeze(0) for t in (query, key, value))  # [1, h, t, d]
        else:
            global_lens = [query.shape[0] * cp]
            q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, h, s, d]
        if cp == 1:
            out = causal_attention(q, k, v, global_lens, self.softmax_scale)
        elif self.cp_comm_type == "p2p":
            out = ring_attention(q, k, v, [n // cp for n in global_lens], self.softmax_scale, self.cp_group)
        else:
            out = ulysses_attention(q, k, v, global_lens, self.softmax_scale, self.cp_group)
        if packed:
            return out.squeeze(0).permute(1, 0, 2)
        return out.permute(2, 0, 1, 3).reshape(out.shape[2], out.shape[0], -1)
