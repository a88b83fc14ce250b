"""Global names of a Megatron-Core model shard's parameters: the same on every layout.

A shard names its parameters locally (``decoder.layers.0`` is the first layer of *this*
pipeline stage, ``local_experts.0`` the first expert of *this* expert-parallel rank). The global
name replaces the layer index with ``layer.layer_number - 1`` (Megatron offsets it by pipeline
and virtual stage) and the local expert index with ``ep_rank * num_local_experts + j`` (the
expert offset Megatron's own ``SequentialMLP.sharded_state_dict`` uses), so that format
mappings and the resharder can address a parameter independently of the layout.
"""

from __future__ import annotations

import re
from typing import Iterator

import torch

_EXPERT_RE = re.compile(r"(\.mlp\.experts\.local_experts\.)(\d+)(\.)")


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The ``GPTModel`` inside DDP / Float16Module wrappers."""
    while hasattr(model, "module"):
        model = model.module
    return model


def is_expert_param(name: str) -> bool:
    """True for a parameter of a mixture-of-experts expert (Megatron's ``mlp.experts``): it is
    split over the expert-tensor-parallel group and held by one expert-parallel rank."""
    return ".mlp.experts." in name


def is_adapter_param(name: str) -> bool:
    """True for a LoRA adapter's parameter (``<linear>.lora.A`` / ``.B``, :mod:`parallel.lora`)."""
    return ".lora." in name


def global_param_names(model: torch.nn.Module, adapters: bool = False) -> Iterator[tuple[str, str, torch.nn.Parameter]]:
    """Yield ``(local_name, global_name, param)`` for a (possibly wrapped) GPTModel shard: its
    weights, and its LoRA adapters' parameters only with ``adapters=True`` (loaders, exporters and
    the resharder move the weights; an adapted linear's weight sync merges its adapter in).

    Global names carry the layer's global index and, for experts, the global expert index, so
    they are the same on every TP / PP / VPP / EP layout."""
    gpt = unwrap(model)
    layers = gpt.decoder.layers if hasattr(gpt, "decoder") else []
    index = {str(j): str(layer.layer_number - 1) for j, layer in enumerate(layers)}
    expert_offset = {}
    for j, layer in enumerate(layers):
        experts = getattr(getattr(getattr(layer, "mlp", None), "experts", None), "local_experts", None)
        if experts is not None:
            from megatron.core import parallel_state as ps

            expert_offset[str(j)] = ps.get_expert_model_parallel_rank() * len(experts)
    for name, param in gpt.named_parameters():
        if not adapters and is_adapter_param(name):
            continue
        gname = name
        if name.startswith("decoder.layers."):
            j, rest = name.split(".")[2], name.split(".", 3)[3]
            if j in expert_offset:
                rest = _EXPERT_RE.sub(lambda m: f"{m[1]}{int(m[2]) + expert_offset[j]}{m[3]}", "." + rest)[1:]
            gname = f"decoder.layers.{index[j]}.{rest}"
        yield name, gname, param
