"""Entry point: ``torchrun --nproc-per-node 2 launchers/train.py [hydra overrides]``.

config -> validate (before any process group) -> init groups -> build models ->
GRPO loop (:mod:`alignment.trainers.grpo`) -> checkpoints. Works the same under
``srun`` and as a single process.
"""

from __future__ import annotations

import json
import os
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import hydra  # noqa: E402
from omegaconf import DictConfig, OmegaConf  # noqa: E402

from alignment.config import register  # noqa: E402

register()


def build(cfg, hf_dir: Path, hf_config, rank: int):
    """This rank's policy (DDP + optimizer), frozen reference (when ``kl_coef > 0``) and vLLM engine,
    all loaded from the HF weights in ``hf_dir``."""
    import torch

    from alignment.models.bridges.llama import get_bridge
    from alignment.models.gpt import build_gpt_model, transformer_config
    from alignment.models.weights import lazy_safetensors, load_hf_weights
    from alignment.rollout.vllm_engine import VLLMEngine
    from alignment.trainers.grpo import Models
    from alignment.trainers.megatron_step import OptimConfig, setup_training

    dtype = getattr(torch, cfg.model.dtype)
    bridge = get_bridge(hf_config)
    hf_state = lazy_safetensors(hf_dir)

    def shard():
        tcfg = transformer_config(hf_config, params_dtype=dtype, **cfg.parallel)
        model = build_gpt_model(hf_config, tcfg)
        load_hf_weights(model, hf_state, bridge)
        return model

    policy, optimizer = setup_training(shard(), OptimConfig(
        lr=cfg.trainer.lr, weight_decay=cfg.trainer.weight_decay, clip_grad=cfg.trainer.clip_grad,
        use_distributed_optimizer=cfg.trainer.use_distributed_optimizer))
    reference = None
    if cfg.algorithm.kl_coef > 0:
        reference = shard().eval()
        for p in reference.parameters():
            p.requires_grad_(False)
    r = cfg.rollout
    engine = VLLMEngine(str(hf_dir), max_model_len=r.max_model_len, kv_cache_gib=r.kv_cache_gib,
                        gpu_memory_utilization=r.gpu_memory_utilization, seed=cfg.seed + rank,
                        dtype=cfg.model.dtype)
    return Models(policy, optimizer, reference, engine, bridge, engine.tokenizer, hf_config.vocab_size)


def run(cfg: DictConfig) -> dict:
    """Run the job ``cfg.algorithm.name`` names; returns the summary written to ``<output_dir>/summary.json``.

    ``sft``, ``rm`` and ``dpo`` train on fixed data (:mod:`launchers.offline_job`), ``ppo`` runs
    :mod:`launchers.ppo_job`; the GRPO family runs the loop below.
    """
    from alignment.config import OFFLINE_ALGORITHMS

    if cfg.algorithm.name in OFFLINE_ALGORITHMS:
        from launchers.offline_job import run as run_offline

        return run_offline(cfg)
    if cfg.algorithm.name == "ppo":
        from launchers.ppo_job import run as run_ppo

        return run_ppo(cfg)
    return run_rl(cfg)


def run_rl(cfg: DictConfig) -> dict:
    """Run a GRPO-family job; returns the summary written to ``<output_dir>/summary.json``."""
    import torch
    import torch.distributed as dist
    from transformers import AutoConfig

    from alignment.config import validate
    from alignment.data.tasks import load_problems
    from alignment.models.hf_assets import prepare_hf_dir
    from alignment.trainers import grpo
    from alignment.trainers.checkpoint import (
        latest_checkpoint,
        load_megatron_checkpoint,
        save_hf_checkpoint,
        save_megatron_checkpoint,
    )
    from parallel.layout import ParallelLayout
    from parallel.state import env_world, init_distributed, shutdown

    rank, world, local_rank = env_world()
    hf_dir = prepare_hf_dir(cfg.model.path)
    hf_config = AutoConfig.from_pretrained(hf_dir)
    validate(cfg, world_size=world, hf_config=hf_config)  # before any process group starts

    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world) if not torch.cuda.is_available() else 8)
    init_distributed(ParallelLayout(world_size=world, **cfg.parallel), seed=cfg.seed)
    from megatron.core import parallel_state as ps

    out = Path(cfg.output_dir)
    writer = None
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
        from torch.utils.tensorboard import SummaryWriter

        writer = SummaryWriter(str(out / "tensorboard"))
    models = build(cfg, hf_dir, hf_config, rank)
    kw = {"generator_kwargs": dict(cfg.data.generator_kwargs)} if cfg.data.task == "arithmetic" else {}
    train = load_problems(cfg.data.task, "train", cfg.data.train_size, seed=cfg.seed, **kw)
    heldout = load_problems(cfg.data.task, "heldout", cfg.data.heldout_size, seed=cfg.seed, **kw)

    def log(values: dict, step: int):
        if writer is not None:
            for k, v in values.items():
                writer.add_scalar(k, v, step)
            writer.flush()

    ckpt_dir, start_step = out / "checkpoints", 0
    latest = latest_checkpoint(ckpt_dir) if cfg.trainer.resume else None
    if latest is not None:
        start_step = load_megatron_checkpoint(models.policy, latest, models.optimizer)
        grpo.sync_weights(models)
        if rank == 0:
            print(f"resumed from {latest} (step {start_step})", flush=True)

    def checkpoint(step: int) -> None:
        save_megatron_checkpoint(models.policy, ckpt_dir / f"step_{step}", optimizer=models.optimizer, step=step)

    acc_before = grpo.evaluate(models, heldout, cfg.data.task, cfg.rollout.eval_max_tokens)
    log({"heldout/accuracy": acc_before}, start_step)
    if rank == 0:
        what = f"at step {start_step} (resumed)" if start_step else "before training"
        print(f"held-out accuracy {what}: {acc_before:.3f} ({len(heldout)} problems)", flush=True)

    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    per_rank = cfg.rollout.prompts_per_step // dp
    steps = range(start_step, cfg.trainer.steps)
    if rank == 0 and cfg.trainer.progress_bar:
        from tqdm import tqdm

        steps = tqdm(steps, desc="grpo", dynamic_ncols=True, initial=start_step, total=cfg.trainer.steps)
    history = []
    for step in steps:
        start = (step * cfg.rollout.prompts_per_step + dp_rank * per_rank) % len(train)
        problems = [train[(start + i) % len(train)] for i in range(per_rank)]
        t0 = time.perf_counter()
        refill_rng = random.Random(hash((cfg.seed, step, dp_rank)))

        def refill(k: int):  # more training problems for DAPO dynamic sampling
            return [train[refill_rng.randrange(len(train))] for _ in range(k)]

        metrics, times = grpo.grpo_step(models, problems, cfg, refill)
        step_time = time.perf_counter() - t0
        metrics["tokens_per_s"] = metrics.pop("tokens") / step_time
        metrics.update({f"time/{k}": v for k, v in times.items()}, **{"time/step": step_time})
        if cfg.trainer.eval_every and (step + 1) % cfg.trainer.eval_every == 0 and step + 1 < cfg.trainer.steps:
            metrics["heldout/accuracy"] = grpo.evaluate(models, heldout, cfg.data.task, cfg.rollout.eval_max_tokens)
        log(metrics, step + 1)
        history.append(metrics)
        if cfg.trainer.save_every and (step + 1) % cfg.trainer.save_every == 0 and step + 1 < cfg.trainer.steps:
            checkpoint(step + 1)
        if rank == 0 and hasattr(steps, "set_postfix"):
            steps.set_postfix(reward=f"{metrics['reward/mean']:.3f}", kl=f"{metrics['kl']:.4f}",
                              s=f"{step_time:.1f}")

    acc_after = grpo.evaluate(models, heldout, cfg.data.task, cfg.rollout.eval_max_tokens)
    log({"heldout/accuracy": acc_after}, cfg.trainer.steps)
    if cfg.trainer.save_checkpoint and start_step < cfg.trainer.steps:
        checkpoint(cfg.trainer.steps)
    if cfg.trainer.export_hf:
        save_hf_checkpoint(models.policy, models.bridge, hf_config, models.tokenizer, out / "hf")
    summary = {"heldout_accuracy_before": acc_before, "heldout_accuracy_after": acc_after, "start_step": start_step,
               "heldout_size": len(heldout), "steps": cfg.trainer.steps, "world_size": world, "history": history}
    if rank == 0:
        print(f"held-out accuracy after training: {acc_after:.3f} (before: {acc_before:.3f})", flush=True)
        (out / "summary.json").write_text(json.dumps(summary, indent=1))
        writer.close()
    dist.barrier()
    models.engine.close()
    shutdown()
    return summary


@hydra.main(version_base=None, config_path="../configs", config_name="grpo")
def main(cfg: DictConfig) -> None:
    """Hydra entry point: compose ``configs/grpo.yaml`` (or ``--config-name sft|rm|dpo|...``)
    with command-line overrides and run."""
    run(cfg)


if __name__ == "__main__":
    main()
