"""Move weights between an HF state dict and this rank's Megatron shard.

Loading reads only the HF tensors this rank's shard needs and slices them on the
spot (no full Megatron model is ever materialised). Exporting all-gathers each
parameter over the tensor-parallel group, maps it to HF names with the bridge, and
shares the stages' tensors over the pipeline group, so every rank ends with the full
HF state dict (what the rollout engine and the HF export need).
"""

from __future__ import annotations

from typing import Callable, Iterator, Mapping

import torch
import torch.distributed as dist

from alignment.models.bridges.llama import LlamaBridge


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The ``GPTModel`` inside DDP / Float16Module wrappers."""
    while hasattr(model, "module"):
        model = model.module
    return model


def global_param_names(model: torch.nn.Module) -> Iterator[tuple[str, str, torch.nn.Parameter]]:
    """Yield ``(local_name, global_name, param)`` for a (possibly wrapped) GPTModel shard.

    Global names carry the layer's global index (``layer.layer_number - 1``, which
    Megatron offsets by the pipeline stage), so they are the same on every PP layout.
    """
    gpt = unwrap(model)
    layers = gpt.decoder.layers if hasattr(gpt, "decoder") else []
    index = {f"decoder.layers.{j}.": f"decoder.layers.{layer.layer_number - 1}." for j, layer in enumerate(layers)}
    for name, param in gpt.named_parameters():
        gname = name
        if name.startswith("decoder.layers."):
            j = name.split(".")[2]
            gname = index[f"decoder.layers.{j}."] + name.split(".", 3)[3]
        yield name, gname, param


@torch.no_grad()
def load_hf_weights(model: torch.nn.Module, hf_state: Mapping[str, torch.Tensor], bridge: LlamaBridge,
                    skip: tuple[str, ...] = ()) -> None:
    """Copy HF weights into this rank's shard (TP slice of its PP stage).

    Args:
        hf_state: HF name -> full tensor (e.g. a ``safetensors.safe_open`` view or a dict).
        skip: global Megatron names to leave as initialised (e.g. a new reward head).
    Raises:
        ValueError: a shape mismatch, naming the parameter.
    """
    from megatron.core import parallel_state as ps

    tp_rank, tp_size = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
    for _, gname, param in global_param_names(model):
        if gname in skip:
            continue
        shard = bridge.to_megatron_shard(gname, hf_state, tp_rank, tp_size)
        if shard.shape != param.shape:
            raise ValueError(f"{gname}: HF gives shard {tuple(shard.shape)}, model has {tuple(param.shape)}")
        param.copy_(shard.to(param.dtype))


@torch.no_grad()
def export_hf_weights(model: torch.nn.Module, bridge: LlamaBridge, dtype: torch.dtype | None = None,
                      source: Callable[[torch.nn.Parameter], torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """Full HF state dict of the model, identical on every rank (collective: all ranks call it).

    ``source`` picks the tensor exported per parameter (default: its data; e.g.
    ``lambda p: p.main_grad`` exports Megatron's accumulated gradients in HF layout).

    TP shards are all-gathered inside each tensor-parallel group; each pipeline stage
    then broadcasts its HF tensors to the other stages of its pipeline group (shapes are
    known from the bridge, so no metadata is exchanged).
    """
    from megatron.core import parallel_state as ps

    tp_group = ps.get_tensor_model_parallel_group()
    tp_size = ps.get_tensor_model_parallel_world_size()
    local: dict[str, torch.Tensor] = {}
    for _, gname, param in global_param_names(model):
        if gname == "output_layer.weight" and bridge.output_layer_tied:
            continue
        p = source(param) if source is not None else param.detach()
        if tp_size > 1 and getattr(param, "tensor_model_parallel", False):
            shards = [torch.empty_like(p) for _ in range(tp_size)]
            dist.all_gather(shards, p.contiguous(), group=tp_group)
        else:
            shards = [p]
        for name, t in bridge.to_hf(gname, shards).items():
            local[name] = t.to(dtype) if dtype is not None else t.clone()
    pp_size = ps.get_pipeline_model_parallel_world_size()
    if pp_size == 1:
        return local
    # Exchange stages: every rank learns which names each stage holds from the bridge.
    pp_group = ps.get_pipeline_model_parallel_group()
    pp_ranks = dist.get_process_group_ranks(pp_group)
    owners = [None] * pp_size
    dist.all_gather_object(owners, sorted(local), group=pp_group)
    full: dict[str, torch.Tensor] = {}
    for stage, names in enumerate(owners):
        for name in names:
            if stage == ps.get_pipeline_model_parallel_rank():
                t = local[name].contiguous()
            else:
                t = torch.empty(bridge.hf_shape(name), dtype=dtype or torch.float32)
            dist.broadcast(t, src=pp_ranks[stage], group=pp_group)
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
