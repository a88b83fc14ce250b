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


@pytest.mark.heavy(cheap="tests/test_convert_checkpoint.py::test_round_trips_and_reshapes_are_exact_for_each_family")
def test_import_gives_transformers_logits_at_another_layout(hf_dir, tmp_path):
    ckpt = tmp_path / "ckpt"
    run_torchrun("convert_worker.py", "import", str(hf_dir), str(ckpt), "2", "1")  # saved at TP=2
    assert (ckpt / "megatron" / "metadata.json").exists() and (ckpt / "hf_config" / "config.json").exists()
    run_torchrun("convert_worker.py", "logits", str(ckpt), "1", "2", str(tmp_path / "l.pt"))  # loaded at PP=2
    ref = _hf_logits(hf_dir)
    assert ref.std() > 0.5
    assert (torch.load(tmp_path / "l.pt") - ref).abs().max() <= 1e-4


@pytest.mark.heavy(cheap="tests/test_convert_checkpoint.py::test_round_trips_and_reshapes_are_exact_for_each_family")
def test_export_of_megatron_own_weights_gives_the_same_logits_in_transformers(hf_dir, tmp_path):
    ckpt, out = tmp_path / "ckpt", tmp_path / "hf"
    run_torchrun("convert_worker.py", "random", str(hf_dir), str(ckpt), "2", "1", str(tmp_path / "m.pt"))
    run_torchrun("convert_worker.py", "export", str(ckpt), str(out), "1", "2")
    megatron = torch.load(tmp_path / "m.pt")
    assert megatron.std() > 0.5
    assert (_hf_logits(out) - megatron).abs().max() <= 1e-4


def test_bad_layout_names_the_flag_before_any_rank_starts(hf_dir, tmp_path, capsys):
    from tools import cli

    out = tmp_path / "x"
    assert cli.main(["convert", "--nproc", "3", "import", str(hf_dir), str(out), "--tp", "3"]) == 2
    assert capsys.readouterr().err.strip().startswith(
        "megalign: error: --tensor_model_parallel_size=3 must divide the model's 4 attention heads")
    assert cli.main(["convert", "--nproc", "2", "export", str(tmp_path), str(out)]) == 2
    assert "is neither a converted checkpoint" in capsys.readouterr().err
    assert not out.exists()


def test_round_trips_and_reshapes_are_exact_for_each_family(hf_dir, tmp_path):
    """All three families through the tool in one launch: the Llama imported at PP 2, reshaped to
    TP 2, exported from one rank's whole model; Qwen3 imported at TP 2, reshaped to PP 2; Qwen3-MoE
    imported with its experts over 2 ranks (EP 2), reshaped to TP 2 x EP 2 with whole experts
    (expert TP 1); both Qwen3 exported at PP 2: every HF tensor back exactly, experts per expert."""
    from tests.dist.tiny_models import save_tiny_dir

    dirs = [hf_dir, *(save_tiny_dir(tmp_path / f, f, seed=4) for f in ("qwen3", "qwen3_moe"))]
    run_torchrun("convert_worker.py", "chain", str(tmp_path / "work"), *map(str, dirs))
    for i, d in enumerate(dirs):
        original = load_file(d / "model.safetensors")
        back = load_file(tmp_path / "work" / str(i) / "hf" / "model.safetensors")
        assert set(original) == set(back), sorted(set(original) ^ set(back))
        assert all(torch.equal(original[k], back[k]) for k in original)
    assert "model.layers.2.mlp.experts.3.down_proj.weight" in back and "model.layers.3.mlp.down_proj.weight" in back
