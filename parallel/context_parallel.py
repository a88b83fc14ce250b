"""Context parallelism: the load-balanced (zig-zag) split of sequences over the CP ranks,
ring attention over that split, and the gather of per-token outputs back to whole sequences.

Layout (Megatron-Core's, and transformer-engine's for packed ``thd`` input): a sequence of
length ``L`` (a multiple of ``2 * cp``) is cut into ``2 * cp`` chunks of ``c = L / (2 cp)``
tokens and CP rank ``r`` holds chunks ``r`` and ``2 cp - 1 - r``. Every rank then has the
same amount of causal work. Packed input applies the split to every sequence and
concatenates the local parts in sequence order. Megatron's RoPE
(``get_pos_emb_on_this_cp_rank``, ``_get_thd_freqs_on_this_cp_rank``) assumes exactly this.

Ring attention (Liu et al. 2023, "Ring Attention with Blockwise Transformers"; the zig-zag
schedule of zhuzilin/ring-flash-attention and Megatron's ``AttnFuncWithCPAndKVP2P``): the
K/V blocks travel round the CP ring by send/recv while each rank attends its queries to the
block it holds; partial outputs merge by their log-sum-exp. With the zig-zag split every
block is either the causal local block or a full block on half of the rows, so each is one
flash-attention call without a mask. Backward runs the ring again and sends dK/dV home
with the blocks.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def zigzag_index(seq_lens: list[int], cp_size: int) -> torch.Tensor:
    """Positions of each CP rank's tokens in the concatenated sequences.

    Args:
        seq_lens: lengths of the sequences laid end to end, each a multiple of ``2 * cp_size``.
        cp_size: number of context-parallel ranks.
    Returns:
        ``[cp_size, sum(seq_lens) / cp_size]`` int64: row ``r`` lists, in rank ``r``'s local
        order, the positions (in the concatenation) of the tokens rank ``r`` holds.
    Raises:
        ValueError: a length not divisible by ``2 * cp_size``.
    """
    rows = [[] for _ in range(cp_size)]
    offset = 0
    for i, length in enumerate(seq_lens):
        if length % (2 * cp_size):
            raise ValueError(f"sequence {i} has length {length}, not a multiple of 2 x context_parallel_size "
                             f"= {2 * cp_size}; pad it (parallel.packing does)")
        c = length // (2 * cp_size)
        for r in range(cp_size):
            rows[r].append(torch.arange(offset + r * c, offset + (r + 1) * c))
            rows[r].append(torch.arange(offset + (2 * cp_size - 1 - r) * c, offset + (2 * cp_size - r) * c))
        offset += length
    return torch.stack([torch.cat(r) if r else torch.zeros(0, dtype=torch.long) for r in rows])


class _GatherFromContextParallel(torch.autograd.Function):
    """All-gather along a new leading dim; backward keeps this rank's slice of the gradient.

    No sum in backward: every CP rank computes the same loss from the gathered tensor, so
    the gradient arriving on each rank is already the whole gradient of that loss.
    """

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        x = x.contiguous()  # before empty_like, which would copy a view's strides
        parts = [torch.empty_like(x) for _ in range(group.size())]
        dist.all_gather(parts, x, group=group)
        return torch.stack(parts)

    @staticmethod
    def backward(ctx, grad):
        return grad[ctx.group.rank()], None


def gather_from_context_parallel(x: torch.Tensor, group) -> torch.Tensor:
    """``[cp, *x.shape]``: every CP rank's ``x`` (same shape on all ranks), differentiable. Any group
    whose ranks all compute one loss from the gathered tensor can use it (also the tensor-parallel
    vocabulary slices: :func:`parallel.vocab_logprobs.vocab_parallel_log_softmax`).

    The gradient of ``x`` is the gathered tensor's gradient at this rank's index, which is
    right when every CP rank evaluates the same function of the gathered tensor (megalign's
    losses: see :mod:`alignment.training.megatron_step`)."""
    return _GatherFromContextParallel.apply(x, group)


def _flash(q, k, v, causal: bool, scale: float):
    """CPU flash attention: ``[B, H, Lq, D]`` out and ``[B, H, Lq]`` float32 log-sum-exp (GQA ok)."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)


def _flash_backward(dout, q, k, v, out, lse, causal: bool, scale: float):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout, q, k, v, out, lse, 0.0, causal, scale=scale)


def _blocks(seg_lens: list[int], rank: int, src: int):
    """For each local sequence, the (query rows, key rows, causal) of rank ``rank``'s queries
    against rank ``src``'s zig-zag chunks: all keys causally (own block), the keys of the first
    chunk only (``src < rank``: its second chunk lies in the future of both query chunks), or
    the queries of the second chunk only (``src > rank``)."""
    offset = 0
    for length in seg_lens:
        c = length // 2
        whole = slice(offset, offset + length)
        if src == rank:
            yield whole, whole, True
        elif src < rank:
            yield whole, slice(offset, offset + c), False
        else:
            yield slice(offset + c, offset + length), whole, False
        offset += length


def _ring_exchange(tensors: list[torch.Tensor], group) -> list[torch.Tensor]:
    """Send ``tensors`` to the next CP rank and receive the previous rank's (same shapes)."""
    n, r = group.size(), group.rank()
    nxt, prv = dist.get_global_rank(group, (r + 1) % n), dist.get_global_rank(group, (r - 1) % n)
    tensors = [t.contiguous() for t in tensors]
    recv = [torch.empty_like(t) for t in tensors]
    ops = [dist.P2POp(dist.isend, t, nxt, group) for t in tensors]
    ops += [dist.P2POp(dist.irecv, t, prv, group) for t in recv]
    for req in dist.batch_isend_irecv(ops):
        req.wait()
    return recv


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, seg_lens, scale, group):
        n, r = group.size(), group.rank()
        out = torch.zeros(q.shape, dtype=torch.float32)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=torch.float32)
        kv = torch.stack([k, v]).contiguous()
        for step in range(n):
            src = (r - step) % n
            for rows, cols, causal in _blocks(seg_lens, r, src):
                o, l = _flash(q[:, :, rows], kv[0][:, :, cols], kv[1][:, :, cols], causal, scale)
                new = torch.logaddexp(lse[:, :, rows], l)
                out[:, :, rows] = (out[:, :, rows] * torch.exp(lse[:, :, rows] - new).unsqueeze(-1)
                                   + o.float() * torch.exp(l - new).unsqueeze(-1))
                lse[:, :, rows] = new
            if step < n - 1:
                [kv] = _ring_exchange([kv], group)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.seg_lens, ctx.scale, ctx.group = seg_lens, scale, group
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        group, scale = ctx.group, ctx.scale
        n, r = group.size(), group.rank()
        dout = dout.contiguous()
        dq = torch.zeros(q.shape, dtype=torch.float32)
        kv = torch.stack([k, v]).contiguous()
        dkv = torch.zeros(kv.shape, dtype=torch.float32)
        for step in range(n):
            src = (r - step) % n
            for rows, cols, causal in _blocks(ctx.seg_lens, r, src):
                # the block's share of the gradient: softmax rows from the FINAL log-sum-exp,
                # D = rowsum(dO * O) from the final output
                gq, gk, gv = _flash_backward(dout[:, :, rows], q[:, :, rows], kv[0][:, :, cols], kv[1][:, :, cols],
                                             out[:, :, rows], lse[:, :, rows], causal, scale)
                dq[:, :, rows] += gq
                dkv[0][:, :, cols] += gk
                dkv[1][:, :, cols] += gv
            # the block (and its gradient so far) moves on; after n moves each dK/dV is home
            if step < n - 1:
                kv, dkv = _ring_exchange([kv, dkv], group)
            elif n > 1:
                [dkv] = _ring_exchange([dkv], group)
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seg_lens: list[int], scale: float,
                   group) -> torch.Tensor:
    """Causal attention of this CP rank's zig-zag tokens against all ranks' keys and values.

    Args:
        q: ``[B, heads, T_local, head_dim]`` this rank's queries (local order, see
            :func:`zigzag_index`); ``k``, ``v``: ``[B, kv_heads, T_local, head_dim]`` (GQA:
            ``heads`` a multiple of ``kv_heads``).
        seg_lens: LOCAL length of each sequence laid along ``T_local`` (global length / cp),
            each even; ``[T_local]`` for one unpacked row per batch entry.
        scale: softmax scale (``1 / sqrt(head_dim)``).
        group: the context-parallel process group.
    Returns:
        ``[B, heads, T_local, head_dim]`` equal to the rows of full causal attention over each
        whole sequence that this rank holds. Differentiable (custom backward, ring again).
    Raises:
        ValueError: a local sequence length that is odd (not a zig-zag pair of chunks).
    """
    if any(length % 2 for length in seg_lens):
        raise ValueError(f"ring_attention: local sequence lengths {seg_lens} must be even (two zig-zag chunks)")
    if sum(seg_lens) != q.shape[2]:
        raise ValueError(f"ring_attention: seg_lens sum to {sum(seg_lens)} but q has {q.shape[2]} tokens")
    return _RingAttention.apply(q, k, v, list(seg_lens), scale, group)
