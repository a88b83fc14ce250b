"""tools/convert_checkpoint.py on a tiny GQA Llama with non-square attention and untied
embeddings (SmolLM2's tokenizer). Import and export are each checked on their
own against transformers (a round trip alone would hide symmetric bugs), then the round
trip and the reshape must give back the HF tensors exactly."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import run_torchrun
from tests.dist.convert_worker import INPUT_IDS
from tests.dist.tiny_llama import save_tiny_hf_dir

pytestmark = pytest.mark.slow  # launches processes: the full suite only (CONTRIBUTING.md, test tiers)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return save_tiny_hf_dir(tmp_path_factory.mktemp("convert") / "tiny", tie_word_embeddings=False)


def _hf_logits(path) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    with torch.no_grad():
        return AutoModelForCausalLM.from_pretrained(path).float().eval()(INPUT_IDS).logits


@pytest.mark.heavy
def test_import_gives_transformers_logits_at_another_layout(hf_dir, tmp_path):
    ckpt = tmp_path / "ckpt"
    run_torchrun("convert_worker.py", "import", str(hf_dir), str(ckpt), "2", "1")  # saved at TP=2
    assert (ckpt / "megatron" / "metadata.json").exists() and (ckpt / "hf_config" / "config.json").exists()
    run_torchrun("convert_worker.py", "logits", str(ckpt), "1", "2", str(tmp_path / "l.pt"))  # loaded at PP=2
    ref = _hf_logits(hf_dir)
    assert ref.std() > 0.5
    assert (torch.load(tmp_path / "l.pt") - ref).abs().max() <= 1e-4


@pytest.mark.heavy
def test_export_of_megatron_own_weights_gives_the_same_logits_in_transformers(hf_dir, tmp_path):
    ckpt, out = tmp_path / "ckpt", tmp_path / "hf"
    run_torchrun("convert_worker.py", "random", str(hf_dir), str(ckpt), "2", "1", str(tmp_path / "m.pt"))
    run_torchrun("convert_worker.py", "export", str(ckpt), str(out), "1", "2")
    megatron = torch.load(tmp_path / "m.pt")
    assert megatron.std() > 0.5
    assert (_hf_logits(out) - megatron).abs().max() <= 1e-4


def test_round_trip_and_reshape_are_exact(hf_dir, tmp_path):
    run_torchrun("convert_worker.py", "import", str(hf_dir), str(tmp_path / "a"), "1", "2")
    run_torchrun("convert_worker.py", "reshape", str(tmp_path / "a"), str(tmp_path / "b"), "2", "1")
    run_torchrun("convert_worker.py", "export", str(tmp_path / "b"), str(tmp_path / "hf"), "1", "1")
    original, back = load_file(hf_dir / "model.safetensors"), load_file(tmp_path / "hf" / "model.safetensors")
    assert set(original) == set(back)
    assert all(torch.equal(original[k], back[k]) for k in original)


def test_bad_layout_names_the_flag(hf_dir, tmp_path):
    with pytest.raises(pytest.fail.Exception, match=r"--tensor_model_parallel_size=3 must divide the model's 4"):
        run_torchrun("convert_worker.py", "import", str(hf_dir), str(tmp_path / "x"), "3", "1", nproc=3)


def test_qwen3_and_qwen3_moe_round_trips_through_expert_and_tensor_layouts(tmp_path):
    """Both new families through the tool: Qwen3 imported at TP 2, reshaped to PP 2; Qwen3-MoE
    imported with its experts over 2 ranks (EP 2), reshaped to TP 2 x EP 2 with whole experts
    (expert TP 1); both exported at PP 2: every HF tensor back exactly, experts per expert."""
    from tests.dist.tiny_models import save_tiny_dir

    dirs = [save_tiny_dir(tmp_path / f, f, seed=4) for f in ("qwen3", "qwen3_moe")]
    run_torchrun("convert_worker.py", "chain", str(tmp_path / "work"), *map(str, dirs))
    for i, d in enumerate(dirs):
        original = load_file(d / "model.safetensors")
        back = load_file(tmp_path / "work" / str(i) / "hf" / "model.safetensors")
        assert set(original) == set(back), sorted(set(original) ^ set(back))
        assert all(torch.equal(original[k], back[k]) for k in original)
    assert "model.layers.2.mlp.experts.3.down_proj.weight" in back and "model.layers.3.mlp.down_proj.weight" in back
