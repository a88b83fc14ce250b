"""Checkpoint conversion between Hugging Face and Megatron-Core's distributed format.

    # HF (safetensors dir, a .gguf file, or "smollm2") -> Megatron distributed checkpoint
    torchrun --standalone --nproc-per-node 2 tools/convert_checkpoint.py import SRC OUT --tp 2
    # Megatron -> HF safetensors directory (transformers and vLLM load it)
    torchrun --standalone --nproc-per-node 2 tools/convert_checkpoint.py export OUT HF_OUT --pp 2
    # Megatron -> Megatron at another layout
    torchrun --standalone --nproc-per-node 4 tools/convert_checkpoint.py reshape OUT OUT_TP4 --tp 4
    # a mixture-of-experts model with its experts over 2 ranks
    torchrun --standalone --nproc-per-node 2 tools/convert_checkpoint.py import SRC OUT --ep 2

A converted checkpoint ``OUT`` holds ``hf_config/`` (the HF ``config.json`` and tokenizer,
written first) and ``megatron/`` (``torch_dist`` shards, written atomically; the training
jobs load the same format). The format mapping is the bridge's
(the model family's table, :mod:`alignment.models.bridge`); this tool only lays the model out on
``--tp`` x ``--pp`` ranks, with ``--ep`` (and ``--etp``) for experts (the world size must be a
multiple of ``tp * pp`` and of ``etp * ep * pp``). Megatron's distributed checkpoints are
layout-free, so any checkpoint loads at any valid TP/PP/EP.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository root

from alignment.models.families import get_bridge, model_dims  # noqa: E402
from alignment.models.gpt import build_gpt_model, transformer_config  # noqa: E402
from alignment.models.hf_assets import prepare_hf_dir  # noqa: E402
from alignment.models.weights import lazy_safetensors, load_hf_weights  # noqa: E402
from alignment.training.checkpoint import (copy_processor_files, load_megatron_checkpoint,  # noqa: E402
                                          save_hf_checkpoint, save_megatron_checkpoint)
from parallel.layout import ParallelLayout, validate_model_layout  # noqa: E402
from parallel.state import env_world, init_distributed, shutdown  # noqa: E402


def _model(hf_config, tp: int, pp: int, ep: int = 1, etp: int | None = None):
    """This rank's GPTModel shard for ``tp`` x ``pp`` (``ep`` x ``etp`` for experts; process
    groups started here). Sequence parallelism is on with TP > 1 (Megatron's MoE needs it; it
    does not change the weights)."""

    sizes = layout_sizes(tp, pp, ep, etp)
    layout = ParallelLayout(world_size=env_world()[1], **sizes)
    validate_model_layout(layout, model_dims(hf_config), prefix="--")
    init_distributed(layout)
    return build_gpt_model(hf_config, transformer_config(hf_config, **sizes))


def layout_sizes(tp: int, pp: int, ep: int = 1, etp: int | None = None) -> dict:
    """The :class:`parallel.layout.ParallelLayout` sizes this tool lays a model out with."""
    return dict(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, sequence_parallel=tp > 1,
                expert_model_parallel_size=ep, expert_tensor_parallel_size=etp)


def check_layout(argv: list[str], world_size: int) -> None:
    """Check the command line ``argv`` (this tool's arguments) against ``world_size`` processes and
    the model's dims, in the launching process, before any rank starts (``megalign convert``).
    A ``.gguf`` or ``"smollm2"`` source is left to the ranks (reading it means converting it).

    Raises:
        parallel.layout.LayoutError: a layout the model or the world size cannot take, naming
            ``--tp`` / ``--pp`` / ``--ep`` / ``--etp``.
        FileNotFoundError: a source that is neither an HF directory nor a checkpoint.
    """
    from transformers import AutoConfig

    args = parser().parse_args(argv)
    src = Path(args.src)
    if args.direction == "import":
        if not src.is_dir():
            return
        hf_dir = src
    else:
        hf_dir = src / "hf_config"
        if not (hf_dir / "config.json").exists():
            if (src / "config.yaml").exists():  # a training checkpoint: its model may be a .gguf or "smollm2"
                return
            raise FileNotFoundError(f"{src} is neither a converted checkpoint (no hf_config/config.json; make one "
                                    "with `megalign convert import`) nor a training checkpoint (no config.yaml)")
    layout = ParallelLayout(world_size=world_size, **layout_sizes(args.tp, args.pp, args.ep, args.etp))
    validate_model_layout(layout, model_dims(AutoConfig.from_pretrained(hf_dir)), prefix="--")


def _load_converted(src: Path, tp: int, pp: int, ep: int = 1, etp: int | None = None):
    """``(model, hf_config, tokenizer)`` from a converted checkpoint, laid out at ``tp`` x ``pp`` (x ``ep``)."""
    from transformers import AutoConfig, AutoTokenizer

    if (src / "hf_config" / "config.json").exists():
        hf_dir, weights = src / "hf_config", src / "megatron"
    elif (src / "config.yaml").exists():  # a training checkpoint: its model is the run's model.path
        from omegaconf import OmegaConf

        hf_dir, weights = Path(prepare_hf_dir(OmegaConf.load(src / "config.yaml").model.path)), src
    else:
        raise FileNotFoundError(f"{src} is neither a converted checkpoint (no hf_config/config.json; make one with "
                                "`convert_checkpoint.py import`) nor a training checkpoint (no config.yaml)")
    hf_config = AutoConfig.from_pretrained(hf_dir)
    model = _model(hf_config, tp, pp, ep, etp)
    load_megatron_checkpoint(model, weights)
    return model, hf_config, AutoTokenizer.from_pretrained(hf_dir)


def _save_converted(model, hf_config, tokenizer, out: Path, assets_from: Path | None = None) -> Path:
    import torch.distributed as dist

    if dist.get_rank() == 0:
        shutil.rmtree(out / "hf_config", ignore_errors=True)
        hf_config.save_pretrained(out / "hf_config")
        tokenizer.save_pretrained(out / "hf_config")
        copy_processor_files(assets_from, out / "hf_config")  # a vision-language model's processor
    dist.barrier()
    return save_megatron_checkpoint(model, out / "megatron")


def hf_to_megatron(src: str, out: str | Path, tp: int = 1, pp: int = 1, ep: int = 1, etp: int | None = None) -> Path:
    """Import an HF model (directory, ``.gguf`` or ``"smollm2"``) as a converted checkpoint at
    ``out``; collective. Returns ``out/megatron``. Raises LayoutError for a layout the model
    cannot take (naming ``--tp``/``--pp``/``--ep``)."""
    from transformers import AutoConfig, AutoTokenizer

    hf_dir = prepare_hf_dir(src)
    hf_config = AutoConfig.from_pretrained(hf_dir)
    model = _model(hf_config, tp, pp, ep, etp)
    load_hf_weights(model, lazy_safetensors(hf_dir), get_bridge(hf_config))
    return _save_converted(model, hf_config, AutoTokenizer.from_pretrained(hf_dir), Path(out), assets_from=hf_dir)


def megatron_to_hf(src: str | Path, out: str | Path, tp: int = 1, pp: int = 1, ep: int = 1,
                   etp: int | None = None) -> Path:
    """Export a converted checkpoint to an HF safetensors directory; collective (rank 0 writes)."""

    model, hf_config, tokenizer = _load_converted(Path(src), tp, pp, ep, etp)
    return save_hf_checkpoint(model, get_bridge(hf_config), hf_config, tokenizer, Path(out),
                              assets_from=Path(src) / "hf_config")


def reshape(src: str | Path, out: str | Path, tp: int = 1, pp: int = 1, ep: int = 1, etp: int | None = None) -> Path:
    """Rewrite a converted checkpoint as if saved at ``tp`` x ``pp`` (x ``ep``); collective."""
    model, hf_config, tokenizer = _load_converted(Path(src), tp, pp, ep, etp)
    return _save_converted(model, hf_config, tokenizer, Path(out))


def parser() -> argparse.ArgumentParser:
    """This tool's command line: ``import|export|reshape SRC OUT [--tp N] [--pp N] [--ep N] [--etp N]``."""
    ap = argparse.ArgumentParser(description="HF <-> Megatron distributed checkpoints (run under torchrun)")
    ap.add_argument("direction", choices=["import", "export", "reshape"])
    ap.add_argument("src", help="import: HF dir, .gguf or 'smollm2'; export/reshape: a converted checkpoint "
                    "(export: or a training checkpoint, <output_dir>/checkpoints/step_N)")
    ap.add_argument("out")
    ap.add_argument("--tp", type=int, default=1, help="tensor_model_parallel_size to lay the model out with")
    ap.add_argument("--pp", type=int, default=1, help="pipeline_model_parallel_size to lay the model out with")
    ap.add_argument("--ep", type=int, default=1, help="expert_model_parallel_size (mixture-of-experts models)")
    ap.add_argument("--etp", type=int, default=None, help="expert_tensor_parallel_size (default: --tp)")
    return ap


def main(argv: list[str] | None = None) -> Path:
    """Run the conversion ``argv`` names (collective under torchrun); returns the output path."""
    args = parser().parse_args(argv)
    fn = {"import": hf_to_megatron, "export": megatron_to_hf, "reshape": reshape}[args.direction]

    try:
        path = fn(args.src, args.out, args.tp, args.pp, args.ep, args.etp)
    finally:
        shutdown()
    print(path)
    return path


if __name__ == "__main__":
    main()
