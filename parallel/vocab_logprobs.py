"""Per-token log-probabilities and entropy from vocabulary-parallel logits, in token chunks.

The full-vocabulary fp32 tensor never exists: every pass reads the logits (any float dtype,
e.g. the model's bf16 output) a chunk of tokens at a time, upcasts that chunk to fp32, and
keeps only per-token statistics. Backward recomputes the softmax chunk by chunk from the
saved logits and the log-sum-exp, and writes the gradient in the logits' dtype. So the
loss adds to the model's own logits only their gradient (same shape and dtype) and a
``[chunk_tokens, V / tp]`` fp32 working tensor, where Megatron's
``vocab_parallel_cross_entropy`` keeps a full fp32 softmax (plus an fp32 copy of bf16
logits). The math is Megatron's (``megatron/core/tensor_parallel/cross_entropy.py``): a max
and a sum of exponentials all-reduced over the tensor-parallel group; the target logit
comes from the one rank whose vocabulary slice holds it. As Megatron-LM and vLLM's sampler,
the log-softmax is taken in fp32 whatever the logits' dtype.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from parallel.context_parallel import gather_from_context_parallel

CHUNK_BYTES = 64 << 20  # fp32 working set per chunk on a GPU: few, large kernels
#: on a CPU: each pass over a chunk (upcast, exp, sums; in backward the softmax and gradient) then stays in the
#: core's caches. Forward + backward of 222 tokens x 49,152 bf16 logits on one core (AMD EPYC with AVX-512,
#: 2026-11-28, glibc's mmap threshold at 1 MiB as in a job): 235 ms in 64 MiB chunks with new working tensors per
#: chunk, 41 ms in 4 MiB chunks with working tensors allocated once, the same numbers to the bit.
CPU_CHUNK_BYTES = 4 << 20


def chunk_tokens(vocab_local: int, chunk_bytes: int = CHUNK_BYTES) -> int:
    """Tokens per chunk so that one ``[chunk, vocab_local]`` fp32 tensor takes ``chunk_bytes``."""
    return max(1, chunk_bytes // (4 * max(vocab_local, 1)))


def default_chunk(logits: torch.Tensor) -> int:
    """Tokens per chunk for ``logits`` ``[..., vocab_local]``: :data:`CHUNK_BYTES` of fp32 on a GPU,
    :data:`CPU_CHUNK_BYTES` elsewhere."""
    return chunk_tokens(logits.shape[-1], CHUNK_BYTES if logits.is_cuda else CPU_CHUNK_BYTES)


def _all_reduce(t: torch.Tensor, op, group) -> None:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(t, op=op, group=group)


class _VocabParallelLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, vocab_start, real_cols, inv_temp, group, chunk):
        v_local = logits.shape[-1]
        x = logits.reshape(-1, v_local)
        t = target.reshape(-1)
        n = x.shape[0]
        local_t = t - vocab_start
        owned = (local_t >= 0) & (local_t < real_cols)
        local_t = torch.where(owned, local_t, torch.zeros_like(local_t))
        m = torch.empty(n, dtype=torch.float32, device=x.device)
        for s in range(0, n, chunk):  # a max is exact in the logits' dtype; inv_temp > 0 commutes with it
            m[s : s + chunk] = x[s : s + chunk, :real_cols].amax(-1).float() * inv_temp
        _all_reduce(m, dist.ReduceOp.MAX, group)
        sums = torch.zeros(3, n, dtype=torch.float32, device=x.device)  # sum e, sum e*x, target logit
        # two fp32 working tensors for every chunk: allocated once (a fresh large allocation costs page faults)
        xbuf = torch.empty(min(chunk, n), real_cols, dtype=torch.float32, device=x.device)
        ebuf = torch.empty_like(xbuf)
        for s in range(0, n, chunk):
            k = min(chunk, n - s)
            xc = xbuf[:k].copy_(x[s : s + k, :real_cols]).mul_(inv_temp)
            e = torch.sub(xc, m[s : s + k, None], out=ebuf[:k]).exp_()
            sums[0, s : s + k] = e.sum(-1)
            sums[2, s : s + k] = xc.gather(1, local_t[s : s + k, None]).squeeze(1)
            sums[1, s : s + k] = e.mul_(xc).sum(-1)
        del xbuf, ebuf
        sums[2] *= owned
        _all_reduce(sums, dist.ReduceOp.SUM, group)
        lse = torch.log(sums[0]) + m
        logprobs = (sums[2] - lse).view(target.shape)
        entropy = (lse - sums[1] / sums[0]).view(target.shape)
        ctx.save_for_backward(logits, local_t, owned, lse)
        ctx.meta = (real_cols, inv_temp, chunk)
        ctx.mark_non_differentiable(entropy)
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, _grad_entropy):
        logits, local_t, owned, lse = ctx.saved_tensors
        real_cols, inv_temp, chunk = ctx.meta
        v_local = logits.shape[-1]
        x = logits.reshape(-1, v_local)
        g = grad_logprobs.reshape(-1).float()
        grad = torch.zeros_like(x)
        go = g * owned
        pbuf = torch.empty(min(chunk, x.shape[0]), real_cols, dtype=torch.float32, device=x.device)
        for s in range(0, x.shape[0], chunk):
            k = min(chunk, x.shape[0] - s)
            # d logprob / d x_j = (onehot_j - softmax_j) / T, on this rank's real columns
            p = pbuf[:k].copy_(x[s : s + k, :real_cols]).mul_(inv_temp).sub_(lse[s : s + k, None]).exp_()
            gc = p.mul_(-g[s : s + k, None])
            gc.scatter_add_(1, local_t[s : s + k, None], go[s : s + k, None])
            grad[s : s + k, :real_cols] = gc.mul_(inv_temp)
        return grad.view(logits.shape), None, None, None, None, None, None


def vocab_parallel_logprobs(logits: torch.Tensor, target: torch.Tensor, vocab_size: int,
                            temperature: float = 1.0, group=None, chunk: int | None = None):
    """Log-probabilities of ``target`` under ``softmax(logits / temperature)`` and the entropy
    (nats) of that distribution, from this tensor-parallel rank's vocabulary slice.

    Args:
        logits: ``[..., V_pad / tp]`` this rank's contiguous slice of the (padded) vocabulary,
            rank ``r`` holding columns ``[r * V_pad / tp, (r + 1) * V_pad / tp)``; any float dtype.
        target: ``[...]`` global token ids (int64).
        vocab_size: the real vocabulary size ``V``; padding columns ``>= V`` are left out.
        temperature: > 0.
        group: the tensor-parallel group (``None`` or size 1: the whole vocabulary is local).
        chunk: tokens per chunk (default :func:`default_chunk`: 64 MiB of fp32 per chunk on a GPU, 4 MiB on a CPU).
    Returns:
        ``(logprobs, entropy)``, both ``[...]`` float32; ``logprobs`` is differentiable with
        respect to ``logits`` (gradient in ``logits.dtype``), ``entropy`` is not.
    Raises:
        ValueError: ``temperature <= 0`` or target/logits shapes that do not match.
    """
    if temperature <= 0:
        raise ValueError(f"temperature={temperature}: must be > 0 (greedy has no log-probabilities to train on)")
    if logits.shape[:-1] != target.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and target {tuple(target.shape)}: "
                         "logits must be target's shape plus the vocabulary dimension")
    tp = dist.get_world_size(group) if group is not None else 1
    rank = dist.get_rank(group) if tp > 1 else 0
    v_local = logits.shape[-1]
    start = rank * v_local
    real_cols = max(0, min(v_local, vocab_size - start))
    if real_cols == 0:
        raise ValueError(f"vocab_size={vocab_size}: tensor-parallel rank {rank} holds only padding "
                         f"(columns {start}..{start + v_local}); use a smaller tensor_model_parallel_size")
    return _VocabParallelLogprobs.apply(logits, target, start, real_cols, 1.0 / temperature, group,
                                        chunk or default_chunk(logits))


def vocab_parallel_log_softmax(logits: torch.Tensor, vocab_size: int, temperature: float = 1.0,
                               group=None) -> torch.Tensor:
    """The whole distribution ``log_softmax(logits / temperature)`` over the real vocabulary, from
    this tensor-parallel rank's slice: what a divergence between two models' distributions (on-policy
    distillation's JSD and forward KL) reads. Unlike :func:`vocab_parallel_logprobs` it makes the
    ``[..., V]`` fp32 tensor, so callers run it on the positions they score only.

    Args:
        logits: ``[..., V_pad / tp]`` this rank's contiguous vocabulary slice (rank ``r`` holds columns
            ``[r * V_pad / tp, (r + 1) * V_pad / tp)``); any float dtype.
        vocab_size: the real vocabulary size ``V``; padding columns ``>= V`` are dropped.
        temperature: > 0.
        group: the tensor-parallel group (``None`` or size 1: the whole vocabulary is local).
    Returns:
        ``[..., V]`` float32 log-probabilities, the same on every rank of ``group``; differentiable with
        respect to ``logits`` (each rank gets its slice's gradient).
    Raises:
        ValueError: ``temperature <= 0``, or a padded vocabulary narrower than ``vocab_size``.
    """
    if temperature <= 0:
        raise ValueError(f"temperature={temperature}: must be > 0")
    if group is None or dist.get_world_size(group) == 1:
        full = logits
    else:  # every rank's slice, in rank order; backward keeps this rank's (every rank computes the same loss)
        full = torch.cat(list(gather_from_context_parallel(logits, group)), dim=-1)
    if full.shape[-1] < vocab_size:
        raise ValueError(f"logits hold {full.shape[-1]} vocabulary columns, fewer than vocab_size={vocab_size}")
    return torch.log_softmax(full[..., :vocab_size].float() / temperature, dim=-1)
