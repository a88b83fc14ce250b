"""Shared Megatron machinery for every trainer: DDP + optimizer setup, one
forward(-backward) pass over micro-batches through ``get_forward_backward_func``
(so pipeline parallelism uses the same code), and vocabulary-parallel logprobs.

Loss convention: a loss function returns its micro-batch's share of the GLOBAL
loss, i.e. already divided by the global normaliser (token count over all
micro-batches and data-parallel ranks). Megatron is configured with
``calculate_per_token_loss=True`` and ``finalize_model_grads(num_tokens=None)`` so it
sums micro-batch losses and data-parallel gradients without averaging them again.
Then the gradient equals the gradient of the global loss, for any micro-batch split
and any data-parallel size (tested in ``tests/dist/grpo_invariance_worker.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Callable

import torch


@dataclass
class OptimConfig:
    """Adam settings for ``get_megatron_optimizer`` (``lr`` per step, ``clip_grad`` max global grad norm)."""

    lr: float = 1e-6
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    use_distributed_optimizer: bool = False  # shard optimizer state over data-parallel ranks (ZeRO-1)


def _finalize_grads_summed(model, num_tokens=None, **kwargs):
    from megatron.core.distributed import finalize_model_grads

    return finalize_model_grads(model, num_tokens=None, **kwargs)


def setup_training(model: torch.nn.Module, optim: OptimConfig):
    """Wrap a GPTModel shard in Megatron DDP and build its optimizer.

    Returns ``(ddp_model, optimizer)``. Uses ``get_megatron_optimizer`` (Adam; apex or
    TE fused kernels on GPU, ``torch.optim.AdamW`` otherwise).
    """
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    config = model.config
    ddp = DistributedDataParallel(
        config,
        DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                      use_distributed_optimizer=optim.use_distributed_optimizer),
        module=model,
    )
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=optim.lr, weight_decay=optim.weight_decay,
                        adam_beta1=optim.adam_beta1, adam_beta2=optim.adam_beta2, adam_eps=optim.adam_eps,
                        clip_grad=optim.clip_grad, bf16=config.bf16, params_dtype=config.params_dtype,
                        use_distributed_optimizer=optim.use_distributed_optimizer),
        [ddp],
    )
    config.no_sync_func = ddp.no_sync
    config.finalize_model_grads_func = _finalize_grads_summed
    return ddp, optimizer


def forward_backward(
    model: torch.nn.Module,
    microbatches: list[dict[str, torch.Tensor]],
    loss_fn: Callable[[dict[str, torch.Tensor], torch.Tensor], tuple[torch.Tensor, dict]],
    *,
    forward_only: bool,
) -> list[dict]:
    """Run all micro-batches through Megatron's schedule (1F1B under PP).

    Args:
        microbatches: each has ``input_ids`` and ``position_ids`` ``[mbs, seq]`` (every
            micro-batch padded to the same ``seq``) plus whatever ``loss_fn`` reads.
        loss_fn: ``(microbatch, logits [mbs, seq, vocab/tp]) -> (loss, metrics)``,
            ``loss`` already divided by the global normaliser.
    Returns:
        the metrics dicts of every micro-batch on the last pipeline stage; ``[]`` elsewhere.
    """
    from megatron.core.pipeline_parallel import get_forward_backward_func

    def loss_func(mb, logits):
        loss, metrics = loss_fn(mb, logits)
        return loss, torch.tensor(1, dtype=torch.int), metrics

    def forward_step(data_iterator, m):
        mb = next(data_iterator)
        logits = m(mb["input_ids"], mb["position_ids"], attention_mask=None)
        return logits, partial(loss_func, mb)

    mbs, seq = microbatches[0]["input_ids"].shape
    return get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iter(microbatches),
        model=[model],
        num_microbatches=len(microbatches),
        seq_length=seq,
        micro_batch_size=mbs,
        forward_only=forward_only,
    )


def mask_padded_vocab(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Set the logits of Megatron's vocabulary-padding rows to the dtype's minimum.

    Args:
        logits: ``[..., vocab_padded / tp]`` this TP rank's slice.
        vocab_size: the real (unpadded) vocabulary size.
    """
    from megatron.core import parallel_state as ps

    v_local = logits.shape[-1]
    start = ps.get_tensor_model_parallel_rank() * v_local
    if start + v_local <= vocab_size:
        return logits
    col = torch.arange(start, start + v_local, device=logits.device)
    return logits.masked_fill(col >= vocab_size, torch.finfo(logits.dtype).min)


def token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Log-probability of each next token under vocabulary-parallel logits.

    Args:
        logits: ``[batch, seq, vocab_padded/tp]``.
        input_ids: ``[batch, seq]``.
    Returns:
        ``[batch, seq]``: position ``t`` holds ``log p(input_ids[t+1] | input_ids[:t+1])``;
        the last position is 0. Differentiable (Megatron's ``vocab_parallel_cross_entropy``).

    Consumes ``logits``: Megatron's cross entropy exponentiates its input in place to
    save memory, so compute anything else from the logits (e.g. entropy) BEFORE this.
    """
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    targets = torch.roll(input_ids, shifts=-1, dims=1)
    logits = mask_padded_vocab(logits.float(), vocab_size)
    lp = -vocab_parallel_cross_entropy(logits, targets)
    return torch.cat([lp[:, :-1], lp.new_zeros(lp.shape[0], 1)], dim=1)


@torch.no_grad()
def token_entropy(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Entropy (nats) of the next-token distribution, ``[batch, seq]``, from
    vocabulary-parallel logits ``[batch, seq, vocab_padded/tp]`` (all-reduced over TP)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    group = ps.get_tensor_model_parallel_group()
    x = mask_padded_vocab(logits.float(), vocab_size)
    m = x.max(dim=-1, keepdim=True).values
    if ps.get_tensor_model_parallel_world_size() > 1:
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
    e = torch.exp(x - m)
    sums = torch.stack([e.sum(-1), (e * x).sum(-1)])
    if ps.get_tensor_model_parallel_world_size() > 1:
        dist.all_reduce(sums, group=group)
    z, ex = sums[0], sums[1]
    return torch.log(z) + m.squeeze(-1) - ex / z


def all_reduce_sum(values: list[float], group=None) -> list[float]:
    """Element-wise sum of ``values`` over the ranks of ``group`` (default: all ranks), in
    float64 so that token counts and metric sums stay exact; collective."""
    import torch.distributed as dist

    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, group=group)
    return t.tolist()
