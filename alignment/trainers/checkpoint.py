"""Checkpoints written atomically: into ``<dir>.tmp`` first, renamed into place by rank 0
once every rank has finished, so a crash never leaves a half-written checkpoint where a
reader (or a resume) would take it for a complete one."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from alignment.models.weights import export_hf_weights, unwrap


def _publish(tmp: Path, final: Path) -> None:
    """Rank 0 swaps ``tmp`` into ``final`` (replacing an older one); all ranks wait."""
    dist.barrier()
    if dist.get_rank() == 0:
        if final.exists():
            old = final.with_name(final.name + ".old")
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, final)
    dist.barrier()


def _fresh_tmp(final: Path) -> Path:
    tmp = final.with_name(final.name + ".tmp")
    if dist.get_rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier()
    return tmp


def save_megatron_checkpoint(model: torch.nn.Module, path: str | os.PathLike) -> Path:
    """Megatron distributed checkpoint (``torch_dist`` format) of the model; collective.
    Loadable at another TP/PP layout with ``dist_checkpointing.load``."""
    from megatron.core import dist_checkpointing

    final = Path(path)
    tmp = _fresh_tmp(final)
    dist_checkpointing.save(unwrap(model).sharded_state_dict(), str(tmp))
    _publish(tmp, final)
    return final


def save_hf_checkpoint(model: torch.nn.Module, bridge, hf_config, tokenizer, path: str | os.PathLike) -> Path:
    """HF directory (``config.json``, ``model.safetensors``, tokenizer) that
    ``transformers.AutoModelForCausalLM.from_pretrained`` loads; collective, rank 0 writes."""
    from safetensors.torch import save_file

    final = Path(path)
    tmp = _fresh_tmp(final)
    state = export_hf_weights(model, bridge)
    if dist.get_rank() == 0:
        save_file({k: v.contiguous() for k, v in state.items()}, str(tmp / "model.safetensors"),
                  metadata={"format": "pt"})
        hf_config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
    _publish(tmp, final)
    return final
