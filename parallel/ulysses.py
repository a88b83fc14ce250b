"""Ulysses sequence parallelism (DeepSpeed-Ulysses, Jacobs et al. 2023, Sec. 3): around
attention, one all-to-all turns "all heads of my sequence shard" into "my heads of the whole
sequence"; attention runs locally on whole sequences; a second all-to-all turns it back.

It shares the context-parallel group and the zig-zag token layout of
:mod:`parallel.context_parallel` (so RoPE, packing and the output gather are the same for
both); after the first all-to-all the tokens are put back in natural order with one index
permutation. With GQA and fewer KV heads than Ulysses ranks, KV heads are replicated so that
each rank holds the KV head its query heads use.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
import torch.nn.functional as F

from parallel.context_parallel import zigzag_index


def check_ulysses_heads(num_heads: int, num_kv_heads: int, ulysses_size: int) -> str | None:
    """The reason ``ulysses_size`` cannot split these (per tensor-parallel rank) head counts,
    or None when it can: query heads must divide evenly and KV heads must either divide
    evenly or divide ``ulysses_size`` (then they are replicated)."""
    if num_heads % ulysses_size:
        return (f"{num_heads} query heads per tensor-parallel rank are not divisible by "
                f"context_parallel_size={ulysses_size}")
    if num_kv_heads % ulysses_size and ulysses_size % num_kv_heads:
        return (f"{num_kv_heads} KV heads per tensor-parallel rank neither divide nor are divisible by "
                f"context_parallel_size={ulysses_size}")
    return None


class _AllToAll(torch.autograd.Function):
    """``x[i]`` goes to rank ``i``; ``out[i]`` comes from rank ``i``. Its own adjoint."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        x = x.contiguous()  # (empty_like would copy a view's strides; the collective writes rows)
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        out = torch.empty_like(grad)
        dist.all_to_all_single(out, grad, group=ctx.group)
        return out, None


def _heads_to_sequence(x: torch.Tensor, group) -> torch.Tensor:
    """``[B, H, T, D]`` (all heads, my tokens) -> ``[B, H/n, n*T, D]`` (my heads, every rank's
    tokens in rank order)."""
    n = group.size()
    b, h, t, d = x.shape
    y = _AllToAll.apply(x.reshape(b, n, h // n, t, d).transpose(0, 1), group)  # [n(src), B, H/n, T, D]
    return y.permute(1, 2, 0, 3, 4).reshape(b, h // n, n * t, d)


def _sequence_to_heads(y: torch.Tensor, group) -> torch.Tensor:
    """Inverse of :func:`_heads_to_sequence`."""
    n = group.size()
    b, hn, nt, d = y.shape
    x = _AllToAll.apply(y.reshape(b, hn, n, nt // n, d).permute(2, 0, 1, 3, 4), group)  # [n(head grp), B, H/n, T, D]
    return x.transpose(0, 1).reshape(b, n * hn, nt // n, d)


#: dtypes FlashAttention's kernels take (fp32 runs SDPA's other kernels)
FLASH_DTYPES = (torch.float16, torch.bfloat16)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seg_lens: list[int],
                     scale: float) -> torch.Tensor:
    """Causal attention within each sequence laid end to end along dim 2.

    Args:
        q: ``[B, heads, T, head_dim]``; ``k``, ``v``: ``[B, kv_heads, T, head_dim]``.
        seg_lens: lengths of the sequences along ``T`` (block-diagonal causal mask).
    Returns:
        ``[B, heads, T, head_dim]``.
    """
    gqa = q.shape[1] != k.shape[1]
    if len(seg_lens) > 1 and q.shape[0] == 1 and q.device.type == "cuda" and q.dtype in FLASH_DTYPES:
        return _varlen_causal(q, k, v, seg_lens, scale)
    with sdpa_backends(q):
        if len(seg_lens) == 1:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
        outs, offset = [], 0
        for length in seg_lens:
            s = slice(offset, offset + length)
            outs.append(F.scaled_dot_product_attention(q[:, :, s], k[:, :, s], v[:, :, s], is_causal=True,
                                                       scale=scale, enable_gqa=gqa))
            offset += length
        return torch.cat(outs, dim=2)


@functools.cache
def _varlen_params() -> frozenset[str]:
    """Argument names of this torch's ``varlen_attn`` (2.11: ``window_size``, no ``enable_gqa``;
    earlier: ``is_causal``), read once instead of on every layer's call."""
    import inspect

    from torch.nn.attention.varlen import varlen_attn

    return frozenset(inspect.signature(varlen_attn).parameters)


def _varlen_causal(q, k, v, seg_lens: list[int], scale: float) -> torch.Tensor:
    """Packed sequences on CUDA in one FlashAttention varlen call (``torch.nn.attention.varlen``,
    ``cu_seqlens`` as in Megatron's thd format) instead of one SDPA call per sequence, whose
    host time grew with the number of sequences (2.1 s vs 0.72 s per SmolLM2 SFT step on an
    H100). ``q``: ``[1, heads, T, d]``; ``k``, ``v``: ``[1, kv_heads, T, d]``."""
    lens = torch.tensor(seg_lens, dtype=torch.int32, device=q.device)
    cu = torch.nn.functional.pad(lens.cumsum(0, dtype=torch.int32), (1, 0))
    qt, kt, vt = (t[0].transpose(0, 1) for t in (q, k, v))  # [T, heads, d]
    n = max(seg_lens)
    return varlen_causal_attention(qt, kt, vt, cu, cu, n, n, scale).transpose(0, 1).unsqueeze(0)


def varlen_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                            cu_seqlens_kv: torch.Tensor, max_seqlen_q: int, max_seqlen_kv: int,
                            scale: float) -> torch.Tensor:
    """Causal attention of packed segments on CUDA, one FlashAttention-2 varlen call
    (``torch.nn.attention.varlen.varlen_attn``). Segment ``s`` has queries
    ``cu_seqlens_q[s] .. cu_seqlens_q[s + 1]`` and keys ``cu_seqlens_kv[s] .. cu_seqlens_kv[s + 1]``;
    with more keys than queries the causal mask is aligned bottom-right (FlashAttention >= 2.1:
    query ``i`` of ``n`` sees keys ``0 .. i + n_k - n``).

    Args:
        q: ``[Tq, heads, d]``; ``k``, ``v``: ``[Tk, kv_heads, d]`` (GQA: heads a multiple of kv_heads).
        cu_seqlens_q, cu_seqlens_kv: ``[S + 1]`` int32 on q's device.
    Returns:
        ``[Tq, heads, d]``.
    Raises:
        NotImplementedError: this torch's ``varlen_attn`` has no ``scale`` and ``scale`` is not ``d ** -0.5``.
    """
    from torch.nn.attention.varlen import varlen_attn

    params = _varlen_params()
    kw = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}
    if q.shape[1] != k.shape[1]:
        if "enable_gqa" in params:
            kw["enable_gqa"] = True
        else:
            rep = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    if "scale" in params:
        kw["scale"] = scale
    elif abs(scale - q.shape[-1] ** -0.5) > 1e-12:
        raise NotImplementedError("this torch's varlen_attn has no scale argument; softmax scale must be 1/sqrt(d)")
    return varlen_attn(q, k, v, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q, max_seqlen_kv, **kw)


def sdpa_backends(q: torch.Tensor):
    """On CUDA, flash then memory-efficient attention before cuDNN's: cuDNN's SDPA builds a graph
    per new shape, and with a new sequence length every micro-batch that cost 1.4 ms of host
    time per call (forward) and 1.6 ms (backward) on an H100, more than the kernels."""
    import contextlib

    if q.device.type != "cuda":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH],
                       set_priority=True)


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seg_lens: list[int], scale: float,
                      group) -> torch.Tensor:
    """Causal attention for this rank's zig-zag tokens by head-parallel all-to-all.

    Args:
        q: ``[B, heads, T_local, head_dim]``; ``k``, ``v``: ``[B, kv_heads, T_local, head_dim]``
            (this rank's tokens, local order of :func:`parallel.context_parallel.zigzag_index`).
        seg_lens: GLOBAL length of each sequence (each a multiple of ``2 * group.size()``).
        scale: softmax scale.
        group: the context-parallel process group (``n`` ranks).
    Returns:
        ``[B, heads, T_local, head_dim]``. Differentiable (all-to-all is its own adjoint).
    Raises:
        ValueError: head counts that ``n`` cannot split (:func:`check_ulysses_heads`).
    """
    n = group.size()
    why = check_ulysses_heads(q.shape[1], k.shape[1], n)
    if why:
        raise ValueError(f"Ulysses (parallel.cp_comm_type=a2a): {why}; use cp_comm_type=p2p (ring) or another size")
    if k.shape[1] % n:  # fewer KV heads than ranks: rank r needs KV head r // (n / kv_heads)
        k, v = (t.repeat_interleave(n // k.shape[1], dim=1) for t in (k, v))
    order = zigzag_index(seg_lens, n).flatten()  # natural position of each gathered token
    natural = torch.argsort(order)
    q, k, v = (_heads_to_sequence(t, group).index_select(2, natural) for t in (q, k, v))
    out = causal_attention(q, k, v, seg_lens, scale)
    return _sequence_to_heads(out.index_select(2, order), group)
