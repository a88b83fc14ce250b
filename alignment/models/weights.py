"""Move weights between an HF state dict and this rank's Megatron shard.

Loading reads only the HF tensors this rank's shard needs and slices them on the
spot (no full Megatron model is ever materialised). Exporting all-gathers each
parameter over its tensor-parallel group, maps it to HF names with the bridge, and
shares what other pipeline stages and expert-parallel ranks hold, so every rank ends with
the full HF checkpoint state dict (what the HF export and the weight check need). Expert
parameters are split over the expert-tensor-parallel group instead of the tensor-parallel one.
"""

from __future__ import annotations

from typing import Callable, Mapping

import torch
import torch.distributed as dist

from alignment.models.bridge import Bridge
from parallel.lora import merged_narrow
from parallel.names import global_param_names, is_expert_param


def tensor_split(expert: bool) -> tuple[int, int, object]:
    """``(rank, size, group)`` of the group a parameter is split over: tensor parallel, or expert
    tensor parallel for expert parameters."""
    from megatron.core import parallel_state as ps

    if expert:
        return (ps.get_expert_tensor_parallel_rank(), ps.get_expert_tensor_parallel_world_size(),
                ps.get_expert_tensor_parallel_group())
    return (ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size(),
            ps.get_tensor_model_parallel_group())


@torch.no_grad()
def load_hf_weights(model: torch.nn.Module, hf_state: Mapping[str, torch.Tensor], bridge: Bridge,
                    skip: tuple[str, ...] = (),
                    main_params: Callable[[torch.nn.Parameter, torch.Tensor], None] | None = None) -> None:
    """Copy HF weights into this rank's shard (TP slice of its PP stage, its EP rank's experts).

    Args:
        hf_state: HF checkpoint name -> full tensor (e.g. :func:`lazy_safetensors` or a dict).
        skip: global Megatron names to leave as initialised (e.g. a new reward head).
        main_params: also receives every loaded shard at the checkpoint's precision, before the
            rounding to the model's dtype (:func:`alignment.training.megatron_step.main_param_writer`:
            a bf16 model's fp32 master weights get the fp32 checkpoint's values).
    Raises:
        ValueError: a shape mismatch, naming the parameter.
    """
    hf_state = bridge.checkpoint_view(hf_state)  # per-expert tensors of a fused-expert checkpoint
    for _, gname, param in global_param_names(model):
        if gname in skip:
            continue
        tp_rank, tp_size, _ = tensor_split(is_expert_param(gname))
        shard = bridge.to_megatron_shard(gname, hf_state, tp_rank, tp_size)
        if shard.shape != param.shape:
            raise ValueError(f"{gname}: HF gives shard {tuple(shard.shape)}, model has {tuple(param.shape)}")
        param.copy_(shard.to(param.dtype))
        if main_params is not None:
            main_params(param, shard)


@torch.no_grad()
def export_hf_weights(model: torch.nn.Module, bridge: Bridge, dtype: torch.dtype | None = None,
                      source: Callable[[torch.nn.Parameter], torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """Full HF checkpoint state dict of the model, identical on every rank (collective: all ranks call it).

    ``source`` picks the tensor exported per parameter (default: its data, with a LoRA-adapted
    linear's adapter merged in, ``W + scale B A``, one weight at a time; e.g.
    ``lambda p: p.main_grad`` exports Megatron's accumulated gradients in HF layout).

    TP shards are all-gathered inside each tensor-parallel group (expert-tensor-parallel group
    for experts); the HF tensors a rank lacks (other pipeline stages, other expert-parallel
    ranks' experts) are then broadcast by their lowest holder, after one exchange of names,
    shapes and dtypes. Experts come in the family's checkpoint form (:meth:`Bridge.to_checkpoint`).
    """
    local: dict[str, torch.Tensor] = {}
    for _, gname, param in global_param_names(model):
        if gname == "output_layer.weight" and bridge.output_layer_tied:
            continue
        p = source(param) if source is not None else merged_narrow(param, 0, 0, param.shape[0])
        _, tp_size, tp_group = tensor_split(is_expert_param(gname))
        if tp_size > 1 and getattr(param, "tensor_model_parallel", False):
            shards = [torch.empty_like(p) for _ in range(tp_size)]
            dist.all_gather(shards, p.contiguous(), group=tp_group)
        else:
            shards = [p]
        for name, t in bridge.to_hf(gname, shards).items():
            local[name] = t.to(dtype) if dtype is not None else t.clone()
    return bridge.to_checkpoint(share_across_ranks(local))


def share_across_ranks(local: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every rank's ``local`` tensors (full HF tensors, each held whole by one or more ranks: other
    pipeline stages, other expert-parallel ranks), identical on every rank: one exchange of names,
    shapes and dtypes, then a broadcast by the lowest holder of each tensor some rank lacks.
    Collective."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return local
    held = [None] * dist.get_world_size()
    dist.all_gather_object(held, {k: (tuple(v.shape), v.dtype) for k, v in local.items()})
    full, device = dict(local), next(iter(local.values())).device if local else None
    owners: dict[str, int] = {}
    for r, names in enumerate(held):
        for name in names:
            owners.setdefault(name, r)
    for name, src in owners.items():
        if all(name in h for h in held):
            continue  # every rank has it already
        shape, dt = held[src][name]
        t = local[name].contiguous() if name in local else torch.empty(shape, dtype=dt, device=device)
        dist.broadcast(t, src=src)
        full[name] = t
    return full

def lazy_safetensors(hf_dir) -> Mapping[str, torch.Tensor]:
    """Mapping view over an HF directory's safetensors files: a tensor is read only when asked for
    (so each rank reads just its shards' sources). Raises KeyError for a missing name."""
    from pathlib import Path
    from safetensors import safe_open

    handles = {}
    for f in sorted(Path(hf_dir).glob("*.safetensors")):
        h = safe_open(str(f), framework="pt")
        for k in h.keys():
            handles[k] = h

    class View(dict):
        def __missing__(self, key):
            return handles[key].get_tensor(key)

        def __contains__(self, key):
            return key in handles

    return View()
