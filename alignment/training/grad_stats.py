"""Gradient norms per layer group (``trainer.grad_stats_every``): ``grad_norm/embedding``,
``grad_norm/layer_07/attention`` (the layer's attention and its input norm), ``grad_norm/layer_07/mlp``
(its MLP or experts and router, with their norm), ``grad_norm/final_norm``, ``grad_norm/output_layer``
(a value model's head: ``grad_norm/value_head`` or its own name). Layers are numbered across pipeline
stages (Megatron's ``layer_number``).

The norms are of the reduced gradients before clipping, counted as Megatron's own gradient norm
counts them (``MegatronOptimizer.get_main_grads_for_grad_norm``): tied (shared) copies and
tensor-parallel duplicates once, with the distributed optimizer each data-parallel rank's own shard
of every bucket (its reduce-scattered part), summed over each optimizer's
``get_grad_stats_parallel_group``. So the groups' squares add up to the step's ``grad_norm``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch

from parallel.names import unwrap

_LAYER = re.compile(r"(.*decoder\.layers\.\d+)\.(.*)")
_REQUESTED: ContextVar[dict[str, float] | None] = ContextVar("grad_stats", default=None)


@contextmanager
def measured(enabled: bool) -> Iterator[dict[str, float]]:
    """Request the policy's gradient norms per layer group for the step trained inside the block
    (``trainer.grad_stats_every``: the loop asks on the steps that log them): yields the dict the step's first
    policy update fills (:func:`requested`, given by the trainers to
    :func:`alignment.training.health.guarded_step`); it stays empty when ``enabled`` is false."""
    stats: dict[str, float] = {}
    token = _REQUESTED.set(stats if enabled else None)
    try:
        yield stats
    finally:
        _REQUESTED.reset(token)


def requested() -> dict[str, float] | None:
    """The dict :func:`measured` asked to fill in this step, or None when no one asked."""
    return _REQUESTED.get()


def layer_groups(model: torch.nn.Module) -> dict[torch.nn.Parameter, str]:
    """This rank's parameters of ``model`` (DDP-wrapped or not) -> their group name (module docstring)."""
    from megatron.core.transformer.transformer_layer import TransformerLayer

    base = unwrap(model)
    layer_of = {name: m.layer_number - 1 for name, m in base.named_modules() if isinstance(m, TransformerLayer)}
    out = {}
    for name, p in base.named_parameters():
        m = _LAYER.match(name)
        if m and m.group(1) in layer_of:
            part = "attention" if m.group(2).startswith(("self_attention", "input_layernorm")) else "mlp"
            out[p] = f"layer_{layer_of[m.group(1)]:02d}/{part}"
        elif "embedding" in name:
            out[p] = "embedding"
        elif "final_layernorm" in name:
            out[p] = "final_norm"
        else:
            out[p] = name.split(".")[0]
    return out


def _owned_grads(opt):
    """``(model parameter, the part of its reduced gradient this rank counts)`` of one optimizer."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    if isinstance(opt, DistributedOptimizer):
        for p in opt.model_param_gbuf_map:
            r = opt._get_model_param_range_map(p)["param"]
            yield p, p.main_grad.view(-1)[r.start : r.end]
        return
    if hasattr(opt, "float16_groups"):  # mixed precision: the bf16 model params (+ fp32 ones)
        params = [p for g in opt.float16_groups + opt.fp32_from_fp32_groups for p in g]
    else:  # FP32Optimizer: the model params themselves
        params = [p for g in opt.optimizer.param_groups for p in g["params"]]
    for p in params:
        g = getattr(p, "main_grad", None)
        g = p.grad if g is None else g
        if g is not None:
            yield p, g


def grad_group_norms(model: torch.nn.Module, optimizer) -> dict[str, float]:
    """``{"grad_norm/<group>": L2 norm}`` of ``model``'s reduced gradients (after the backward
    passes' reduction, before ``optimizer.step()`` clips them), over every rank. Collective: one
    all-reduce per chained optimizer."""
    import torch.distributed as dist
    from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate
    from megatron.core.transformer.module import param_is_not_shared

    groups = layer_groups(model)
    names = sorted(set(groups.values()))
    index = {n: i for i, n in enumerate(names)}
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    total = torch.zeros(len(names), dtype=torch.float32, device=device)
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        sums = torch.zeros_like(total)
        for p, g in _owned_grads(opt):
            if p in groups and param_is_not_shared(p) and param_is_not_tensor_parallel_duplicate(
                    p, getattr(opt, "tp_group", None)):
                sums[index[groups[p]]] += g.float().square().sum().to(device)
        dist.all_reduce(sums, group=opt.get_grad_stats_parallel_group())
        total += sums
    return {f"grad_norm/{n}": math.sqrt(v) for n, v in zip(names, total.tolist())}
