"""The recipes for real clusters (``configs/recipes/``) cannot rot: each passes ``megalign train
--dry-run`` at its cluster's world size on a stand-in of its model (the real ``config.json`` shapes
from ``tools/model_configs/``, SmolLM2's tokenizer, no weights), with the GPU check answered as a
GPU node would, and its memory per GPU (the layout planner's estimate, :func:`tools.plan_layout.job_memory`)
fits an H100's 80 GiB with the planner's 10 % headroom."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tools import cli
from tools.plan_layout import CONFIG_DIR, job_memory, load_model_config

ROOT = Path(__file__).resolve().parents[1]
H100_GIB, HEADROOM = 80, 0.1

#: recipe -> (shipped model config, nodes, GPUs per node)
RECIPES = {
    "grpo-qwen3-1.7b-gsm8k-1n8g": ("qwen3-1.7b", 1, 8),
    "dpo-qwen3-8b-lora-1n8g": ("qwen3-8b", 1, 8),
    "grpo-qwen3-30b-a3b-gsm8k-4n8g": ("qwen3-30b-a3b", 4, 8),
}


def test_every_recipe_is_listed():
    assert sorted(RECIPES) == sorted(p.stem for p in (ROOT / "configs" / "recipes").glob("*.yaml"))


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    from tests.dist.tiny_llama import save_tiny_hf_dir

    return save_tiny_hf_dir(tmp_path_factory.mktemp("tok") / "tiny")


def stand_in(tokenizer_dir: Path, model: str, where: Path) -> Path:
    """An HF directory with ``model``'s real config.json and a tokenizer; its safetensors file holds
    no tensor."""
    from safetensors.torch import save_file

    where.mkdir(parents=True)
    save_file({}, str(where / "model.safetensors"))
    for f in tokenizer_dir.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            (where / f.name).write_bytes(f.read_bytes())
    config = json.loads((CONFIG_DIR / f"{model}.json").read_text())
    config.pop("_megalign_note", None)
    (where / "config.json").write_text(json.dumps(config))
    return where


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_recipe_dry_run_and_memory_plan(recipe, tokenizer_dir, tmp_path, monkeypatch, capfd):
    import torch

    from launchers.preflight import compose

    model, nodes, gpus = RECIPES[recipe]
    path = stand_in(tokenizer_dir, model, tmp_path / model)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the cluster config's GPU check, as on a node
    overrides = [f"model.path={path}", f"output_dir={tmp_path / 'out'}"]
    args = ["--dry-run", "--nproc", str(gpus), "--config-name", f"recipes/{recipe}", *overrides]
    if nodes > 1:
        args += ["--nnodes", str(nodes), "--rdzv-endpoint", "head-node:29500"]
    status = cli.train(args)
    out, err = capfd.readouterr()
    assert status == 0 and out.startswith(f"ok: recipes/{recipe}") and f"{nodes * gpus} process(es)" in out, out + err

    cfg = compose(f"recipes/{recipe}", overrides)
    assert (cfg.cluster.nodes, cfg.cluster.gpus_per_node) == (nodes, gpus)
    memory = job_memory(cfg, load_model_config(model), nodes * gpus, H100_GIB)
    usable = (1 - HEADROOM) * H100_GIB * 2**30
    print(recipe, f"{memory.total / 2**30:.1f} GiB per GPU of {usable / 2**30:.0f} usable",
          {k: round(v / 2**30, 1) for k, v in memory.training.as_dict().items()})
    assert 0 < memory.total <= usable
    assert memory.training.weights > 0 and memory.training.activations > 0


def test_a_recipe_too_big_for_the_gpu_is_caught():
    """The check can fail: the 8B DPO recipe without LoRA, at 4 pairs per forward, does not fit."""
    from launchers.preflight import compose

    cfg = compose("recipes/dpo-qwen3-8b-lora-1n8g", ["model.path=/x", "model.lora.rank=0",
                                                      "trainer.micro_batch_size=4"])
    memory = job_memory(cfg, load_model_config("qwen3-8b"), 8, H100_GIB)
    assert memory.total > (1 - HEADROOM) * H100_GIB * 2**30
