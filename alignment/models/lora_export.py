"""LoRA adapters of a Megatron shard in Hugging Face PEFT's format (``adapter_config.json`` +
``adapter_model.safetensors``, which ``peft.PeftModel.from_pretrained`` loads onto the HF base).

A fused Megatron linear carries one adapter, PEFT one per HF projection; the fused one splits
exactly. ``linear_qkv = [q; k; v]`` (rows interleaved per query group) with ``A [r, hidden]``
and ``B [rows, r]`` gives ``q_proj``, ``k_proj``, ``v_proj`` each with the same ``A`` and its own
rows of ``B``: ``x W_q^T + s x A^T B_q^T`` is the q rows of the fused output. ``linear_fc1``
likewise gives ``gate_proj`` / ``up_proj``. A row-parallel linear maps to one HF projection
(``o_proj``, ``down_proj``) with its ``A`` gathered over TP and ``B`` whole. The rows and columns
are de-interleaved by the family's own mapping (the bridge's ``to_hf`` of the weight, applied to
``B`` or ``A``, whose rows or columns are laid out as the weight's), so this module knows no family.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.distributed as dist

from alignment.models.weights import _tp, share_across_ranks
from parallel.names import global_param_names


@torch.no_grad()
def export_lora_adapters(model: torch.nn.Module, bridge) -> dict[str, torch.Tensor]:
    """PEFT-named adapter tensors of the whole model, identical on every rank (collective):
    ``base_model.model.<hf module>.lora_A.weight`` ``[r, in]`` and ``...lora_B.weight``
    ``[out, r]`` for every HF projection of an adapted Megatron linear, in the adapters' dtype."""
    local: dict[str, torch.Tensor] = {}
    for _, gname, param in global_param_names(model):
        lora = getattr(param, "lora_adapter", None)
        if lora is None:
            continue
        _, tp_size, tp_group = _tp(False)
        split = lora.B if lora.kind == "column" else lora.A
        shards = [split.detach()]
        if tp_size > 1:
            shards = [torch.empty_like(split) for _ in range(tp_size)]
            dist.all_gather(shards, split.detach().contiguous(), group=tp_group)
        for hf_name, t in bridge.to_hf(gname, shards).items():
            module = "base_model.model." + hf_name.removesuffix(".weight")
            a, b = (lora.A.detach(), t) if lora.kind == "column" else (t, lora.B.detach())
            local[f"{module}.lora_A.weight"] = a.clone()
            local[f"{module}.lora_B.weight"] = b.clone()
    return share_across_ranks(local)


def save_peft_adapter(model: torch.nn.Module, bridge, spec, base_model: str, path: str | os.PathLike) -> Path:
    """Write ``path`` as a PEFT LoRA adapter directory for the causal LM ``base_model`` (an HF
    directory or hub id: ``adapter_config.json`` names it); collective, rank 0 writes, published
    atomically. ``spec``: the :class:`parallel.lora.LoRASpec` the adapters were built with.
    The config is PEFT's own (``peft.LoraConfig.save_pretrained``): ``r``, ``lora_alpha``,
    ``lora_dropout``, ``target_modules`` = the HF projections found.

    Raises:
        ImportError: peft is not installed (``pip install peft``).
    """
    from peft import LoraConfig
    from safetensors.torch import save_file

    from alignment.trainers.checkpoint import _fresh_tmp, _publish

    tensors = export_lora_adapters(model, bridge)
    final = Path(path)
    tmp = _fresh_tmp(final)
    if dist.get_rank() == 0:
        targets = sorted({k.split(".")[-3] for k in tensors})  # ...<module>.lora_A.weight
        LoraConfig(r=spec.rank, lora_alpha=spec.alpha, lora_dropout=spec.dropout, target_modules=targets,
                   bias="none", task_type="CAUSAL_LM", base_model_name_or_path=str(base_model)).save_pretrained(tmp)
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp / "adapter_model.safetensors"),
                  metadata={"format": "pt"})
    _publish(tmp, final)
    return final
