"""Which checkpoint directories count and which go (alignment/training/checkpoint.py), on directories
made by hand: ``checkpoint_step`` / ``latest_checkpoint`` take complete ``step_N`` only, and
``prune_checkpoints`` (``trainer.keep_last``) keeps the newest N complete ones, removes older
leftovers of interrupted saves, never a newer one, and a kill while deleting leaves nothing that
looks complete. End to end: tests/test_staleness.py (a killed and resumed run with keep_last=2)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from alignment.training.checkpoint import checkpoint_step, latest_checkpoint, prune_checkpoints


def _step(root: Path, name: str, complete: bool = True) -> Path:
    d = root / name
    (d / "policy").mkdir(parents=True)
    (d / "policy" / "shard").write_bytes(b"x" * 10)
    if complete:
        (d / "metadata.json").write_text(json.dumps({"step": 1}))
    return d


def test_prune_keeps_the_newest_complete_ones_and_drops_older_leftovers(tmp_path):
    root = tmp_path / "checkpoints"
    for n in (1, 2, 3, 4):
        _step(root, f"step_{n}")
    _step(root, "step_2.tmp", complete=False)  # an interrupted save of an older step
    _step(root, "step_3.old", complete=False)
    _step(root, "step_5.tmp", complete=False)  # newer than every complete one: never touched
    _step(root, "step_1.deleting", complete=True)  # a deletion a kill interrupted
    (root / "hf").mkdir()
    assert latest_checkpoint(root).name == "step_4" and checkpoint_step(root / "step_1.deleting") is None
    deleted = prune_checkpoints(root, 2)
    assert sorted(p.name for p in root.iterdir()) == ["hf", "step_3", "step_4", "step_5.tmp"]
    assert sorted(p.name for p in deleted) == ["step_1", "step_1.deleting", "step_2", "step_2.tmp", "step_3.old"]
    assert prune_checkpoints(root, 2) == []  # nothing more to do
    assert [p.name for p in prune_checkpoints(root, 1)] == ["step_3"]
    assert latest_checkpoint(root).name == "step_4"
    with pytest.raises(ValueError, match="trainer.keep_last=0"):
        prune_checkpoints(root, 0)


def test_prune_without_checkpoints_does_nothing(tmp_path):
    root = tmp_path / "checkpoints"
    _step(root, "step_3.tmp", complete=False)
    assert prune_checkpoints(root, 1) == [] and (root / "step_3.tmp").is_dir()


def test_an_export_says_its_tensors_dtype_and_keeps_the_models_own_tokenizer(tmp_path, tiny_model_dir):
    """The pieces of ``save_hf_checkpoint`` on bf16 tensors of a model whose base config says float32, with a
    tokenizer wrapped as vLLM wraps it: ``config.json`` says bfloat16, the tokenizer files are the base's, and
    transformers and vLLM's loaders read the directory (tests/export_check.py)."""
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig

    from alignment.training.checkpoint import config_with_dtype, copy_tokenizer_files
    from tests.export_check import check_export

    assert AutoConfig.from_pretrained(tiny_model_dir).dtype == torch.float32
    state = {k: v.to(torch.bfloat16) for k, v in load_file(tiny_model_dir / "model.safetensors").items()}
    out = tmp_path / "hf"
    out.mkdir()
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    config_with_dtype(AutoConfig.from_pretrained(tiny_model_dir), state).save_pretrained(out)
    assert copy_tokenizer_files(tiny_model_dir, out)
    check_export(out, tiny_model_dir)
    assert not copy_tokenizer_files(tmp_path / "nothing", tmp_path)  # no tokenizer there: the caller saves one
