"""LoRA adapters of a Megatron shard in Hugging Face PEFT's format (``adapter_config.json`` +
``adapter_model.safetensors``, which ``peft.PeftModel.from_pretrained`` loads onto the HF base).

A fused Megatron linear carries one adapter, PEFT one per HF projection; the fused one splits
exactly. ``linear_qkv = [q; k; v]`` (rows interleaved per query group) with ``A [r, hidden]``
and ``B [rows, r]`` gives ``q_proj``, ``k_proj``, ``v_proj`` each with the same ``A`` and its own
rows of ``B``: ``x W_q^T + s x A^T B_q^T`` is the q rows of the fused output. ``linear_fc1``
likewise gives ``gate_proj`` / ``up_proj``. A row-parallel linear maps to one HF projection
(``o_proj``, ``down_proj``) with its ``A`` gathered over TP and ``B`` whole; a replicated linear (a
vision tower's) to its one HF linear as it is. The rows and columns
are de-interleaved by the family's own mapping (the bridge's ``to_hf`` of the weight, applied to
``B`` or ``A``, whose rows or columns are laid out as the weight's), so this module knows no family.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Callable, Mapping

import torch
import torch.distributed as dist

from alignment.models.weights import share_across_ranks, tensor_split
from parallel.atomic_dir import fresh_tmp, publish
from parallel.names import global_param_names, is_expert_param

log = logging.getLogger(__name__)


def _modules(bridge, gname: str) -> list[tuple[str, str]]:
    """``(hf weight name, PEFT module prefix)`` of each HF projection of Megatron weight ``gname``."""
    return [(n, "base_model.model." + n.removesuffix(".weight")) for n in bridge.hf_names(gname)]


@torch.no_grad()
def export_lora_adapters(model: torch.nn.Module, bridge,
                         source: Callable[[torch.nn.Parameter], torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """PEFT-named adapter tensors of the whole model, identical on every rank (collective):
    ``base_model.model.<hf module>.lora_A.weight`` ``[r, in]`` and ``...lora_B.weight``
    ``[out, r]`` for every HF projection of an adapted Megatron linear, in the adapters' dtype.
    ``source`` picks the tensor exported per adapter parameter (default its data; e.g.
    ``lambda p: p.main_grad`` for the gradients: a fused linear's shared ``A`` then carries the
    gradient of the sum over its projections)."""
    read = source or (lambda p: p.detach())
    local: dict[str, torch.Tensor] = {}
    for _, gname, param in global_param_names(model):
        lora = getattr(param, "lora_adapter", None)
        if lora is None:
            continue
        _, tp_size, tp_group = tensor_split(is_expert_param(gname))
        split = read(lora.B if lora.kind != "row" else lora.A)
        shards = [split]
        if tp_size > 1:
            shards = [torch.empty_like(split) for _ in range(tp_size)]
            dist.all_gather(shards, split.contiguous(), group=tp_group)
        for hf_name, t in bridge.to_hf(gname, shards).items():
            module = "base_model.model." + hf_name.removesuffix(".weight")
            a, b = (read(lora.A), t) if lora.kind != "row" else (t, read(lora.B))
            local[f"{module}.lora_A.weight"] = a.clone()
            local[f"{module}.lora_B.weight"] = b.clone()
    return share_across_ranks(local)


@torch.no_grad()
def load_lora_adapters(model: torch.nn.Module, bridge, tensors: Mapping[str, torch.Tensor]) -> None:
    """PEFT-named adapter tensors (:func:`export_lora_adapters`' form, e.g. a PEFT
    ``adapter_model.safetensors``) into this shard's adapters (its TP slices).

    Raises:
        KeyError: an adapted linear's tensor is missing.
        ValueError: the projections of one fused linear (``q_proj`` / ``k_proj`` / ``v_proj``,
            ``gate_proj`` / ``up_proj``) have different ``lora_A``: they cannot share the fused
            linear's adapter.
    """
    for _, gname, param in global_param_names(model):
        lora = getattr(param, "lora_adapter", None)
        if lora is None:
            continue
        tp_rank, tp_size, _ = tensor_split(is_expert_param(gname))
        pairs = _modules(bridge, gname)
        if lora.kind != "row":
            a = tensors[f"{pairs[0][1]}.lora_A.weight"]
            for _, module in pairs[1:]:
                if not torch.equal(tensors[f"{module}.lora_A.weight"], a):
                    raise ValueError(f"{module}.lora_A differs from {pairs[0][1]}.lora_A: the projections of "
                                     f"{gname} share one adapter A in Megatron's fused linear")
            b = bridge.to_megatron_shard(gname, {n: tensors[f"{m}.lora_B.weight"] for n, m in pairs}, tp_rank, tp_size)
        else:
            (name, module), = pairs
            a = bridge.to_megatron_shard(gname, {name: tensors[f"{module}.lora_A.weight"]}, tp_rank, tp_size)
            b = tensors[f"{module}.lora_B.weight"]
        lora.A.copy_(a)
        lora.B.copy_(b)


def save_peft_adapter(model: torch.nn.Module, bridge, spec, base_model: str,
                      path: str | os.PathLike) -> Path | None:
    """Write ``path`` as a PEFT LoRA adapter directory for the causal LM ``base_model`` (an HF
    directory or hub id: ``adapter_config.json`` names it); collective, rank 0 writes, published
    atomically. ``spec``: the :class:`parallel.lora.LoRASpec` the adapters were built with.
    The config is PEFT's own (``peft.LoraConfig.save_pretrained``): ``r``, ``lora_alpha``,
    ``lora_dropout``, ``target_modules`` = the HF projections found.

    Experts of a MoE model are written per expert as the HF checkpoint names them
    (``mlp.experts.<e>.gate_proj`` ...); PEFT fuses them on load into its parameter adapters of
    transformers 5's stacked experts (``gate_up_proj`` at rank 2r, block-diagonal: exact), which
    take no dropout, so ``lora_dropout`` is written as 0 then (dropout changes training only). PEFT
    0.21 then also maps the dense MLP projections of the same names onto the experts: a model
    with dense MLP layers *and* adapted experts loses its dense MLP adapters in PEFT (logged);
    the merged export is exact either way.

    A family whose checkpoints fuse the experts (Qwen3-VL-MoE) with adapted experts gets no directory (None,
    logged): PEFT 0.21 maps per-expert adapters onto fused experts only for checkpoints that store them per
    expert, and loaded such a directory with the experts' adapters silently dropped. The merged export holds them.

    Raises:
        ImportError: peft is not installed (``pip install peft``).
    """
    from peft import LoraConfig
    from safetensors.torch import save_file

    tensors = export_lora_adapters(model, bridge)
    if bridge.family.fused_experts is not None and any(".experts." in k for k in tensors):
        if dist.get_rank() == 0:
            log.warning("%s not written: PEFT cannot load per-expert LoRA adapters onto %s's fused experts (it drops "
                        "them); the merged export (hf/) holds them", path, bridge.family.name)
        return None
    final = Path(path)
    tmp = fresh_tmp(final)
    if dist.get_rank() == 0:
        targets = sorted({k.split(".")[-3] for k in tensors})  # ...<module>.lora_A.weight
        experts = {k.split(".")[-3] for k in tensors if ".experts." in k}
        if experts & {k.split(".")[-3] for k in tensors if ".experts." not in k}:
            log.warning("hf_adapter: PEFT maps %s onto the MoE experts, so the dense MLP layers' adapters of these "
                        "names will not load; the merged export holds them", sorted(experts))
        dropout = 0.0 if experts else spec.dropout  # PEFT's expert adapters take none
        LoraConfig(r=spec.rank, lora_alpha=spec.alpha, lora_dropout=dropout, target_modules=targets,
                   bias="none", task_type="CAUSAL_LM", base_model_name_or_path=str(base_model)).save_pretrained(tmp)
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp / "adapter_model.safetensors"),
                  metadata={"format": "pt"})
    publish(tmp, final)
    return final
