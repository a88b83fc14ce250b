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
    lines = out.splitlines()
    assert status == 0 and lines[-1].startswith(f"ok: recipes/{recipe}") and f"{nodes * gpus} process(es)" in out, \
        out + err
    [plan] = [line for line in lines if line.startswith("memory: ")]  # the dry run's memory plan, checked
    assert "GiB per GPU of 80 GiB" in plan, plan

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


def test_the_dry_run_refuses_a_layout_the_planner_puts_above_the_gpu(tokenizer_dir, tmp_path, monkeypatch, capfd):
    """``megalign train --dry-run`` compares the planner's estimate with ``cluster.gpu_memory_gib`` (80 for the
    H100 clusters): the 8B DPO recipe without LoRA, 4 pairs per forward, is one line and exit status 2."""
    import torch

    path = stand_in(tokenizer_dir, "qwen3-8b", tmp_path / "qwen3-8b")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    status = cli.train(["--dry-run", "--nproc", "8", "--config-name", "recipes/dpo-qwen3-8b-lora-1n8g",
                        f"model.path={path}", f"output_dir={tmp_path / 'out'}", "model.lora.rank=0",
                        "trainer.micro_batch_size=4"])
    out, err = capfd.readouterr()
    assert status == 2 and (out + err).count("\n") == 1, out + err
    assert "GiB per GPU of 80 GiB" in err and "more than 95% of cluster.gpu_memory_gib=80" in err, err


def test_plan_reads_a_job(capsys):
    """``megalign plan --config-name JOB [overrides]`` plans the job's own model, cluster, dtype, micro-batch,
    sequence length, optimizer and colocated engine, the same table ``--model`` flags give."""
    from tools import plan_layout

    assert cli.main(["plan", "--config-name", "recipes/grpo-qwen3-1.7b-gsm8k-1n8g", "model.path=qwen3-1.7b"]) == 0
    out = capsys.readouterr().out
    first, table = out.split("\n", 1)
    flags = ["--model", "qwen3-1.7b", "--nodes", "1", "--gpus-per-node", "8", "--dtype", "bfloat16", "--seq-length",
             "1536", "--micro-batch-size", "4", "--lora-rank", "0", "--distributed-optimizer", "--gpu-memory-gib", "80.0",
             "--rollout-tp", "1", "--kv-cache-tokens", str(1536 * 64 * 8 // 8)]
    assert first == f"recipes/grpo-qwen3-1.7b-gsm8k-1n8g: grpo on qwen3-1.7b; planned with {' '.join(flags[2:])}"
    plan_layout.main(flags)
    assert capsys.readouterr().out == table and "recommended: TP=1 PP=1 CP=1 DP=8" in table
    with pytest.raises(SystemExit):
        cli.main(["plan", "--config-name", "grpo", "trainer.stpes=3"])
    assert capsys.readouterr().err == ("megalign plan: error: trainer.stpes: no such key; did you mean trainer.steps? "
                                       "(megalign's schema is closed: a new key is refused with or without +)\n")
