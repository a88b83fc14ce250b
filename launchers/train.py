"""Entry point: ``torchrun --nproc-per-node 2 launchers/train.py [hydra overrides]``.

config -> validate (before any process group) -> init groups -> build models ->
GRPO loop (:mod:`alignment.trainers.grpo`) -> checkpoints. Works the same under
``srun`` and as a single process.
"""

from __future__ import annotations

import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import hydra  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

from alignment.config import register  # noqa: E402

register()


def build(cfg, hf_dir: Path, hf_config, rank: int):
    """This rank's policy (DDP + optimizer), frozen reference (when ``kl_coef > 0``) and rollout
    engine (``rollout.backend``), all loaded from the HF weights in ``hf_dir``."""
    from alignment.models.families import get_bridge
    from alignment.models.gpt import build_gpt_model
    from alignment.models.weights import lazy_safetensors, load_hf_weights
    from alignment.trainers.grpo import Models
    from alignment.trainers.megatron_step import OptimConfig, main_param_writer, setup_training
    from alignment.trainers.offload import DevicePlacement, offload_enabled
    from launchers.common import job_transformer_config, rollout_engine

    bridge = get_bridge(hf_config)
    hf_state = lazy_safetensors(hf_dir)

    model = build_gpt_model(hf_config, job_transformer_config(cfg, hf_config))
    policy, optimizer = setup_training(model, OptimConfig(
        lr=cfg.trainer.lr, weight_decay=cfg.trainer.weight_decay, clip_grad=cfg.trainer.clip_grad,
        use_distributed_optimizer=cfg.trainer.use_distributed_optimizer))
    load_hf_weights(model, hf_state, bridge, main_params=main_param_writer(optimizer))
    reference = None
    if cfg.algorithm.kl_coef > 0:
        reference = build_gpt_model(hf_config, job_transformer_config(cfg, hf_config)).eval()
        load_hf_weights(reference, hf_state, bridge)
        reference.requires_grad_(False)
    del hf_state  # unmaps the safetensors files (their pages count in this process's RSS)
    engine, resharder = rollout_engine(cfg, hf_dir, policy, bridge, hf_config.vocab_size, rank)
    placement = DevicePlacement(enabled=offload_enabled(cfg.trainer.offload))
    placement.add_model("policy", policy, optimizer)
    placement.add_model("reference", reference)
    return Models(policy, optimizer, reference, engine, bridge, engine.tokenizer, hf_config.vocab_size, placement,
                  resharder)


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
    from megatron.core import parallel_state as ps

    from alignment.data.tasks import load_problems
    from alignment.trainers import grpo
    from alignment.trainers.checkpoint import (
        latest_checkpoint,
        load_megatron_checkpoint,
        save_hf_checkpoint,
        save_megatron_checkpoint,
    )
    from alignment.trainers.offload import trainable
    from launchers import preemption
    from launchers.common import start
    from launchers.profiling import peak_rss_bytes

    job = start(cfg)  # validates the config before any process group starts
    models = build(cfg, job.hf_dir, job.hf_config, job.rank)
    kw = {"generator_kwargs": dict(cfg.data.generator_kwargs)} if cfg.data.task in ("arithmetic", "length") else {}
    train = load_problems(cfg.data.task, "train", cfg.data.train_size, seed=cfg.seed, **kw)
    heldout = load_problems(cfg.data.task, "heldout", cfg.data.heldout_size, seed=cfg.seed, **kw)

    ckpt_dir, start_step = job.out / "checkpoints", 0
    latest = latest_checkpoint(ckpt_dir) if cfg.trainer.resume else None
    if latest is not None:
        start_step = load_megatron_checkpoint(models.policy, latest, models.optimizer)
        grpo.sync_weights(models, cfg.rollout.check_weight_sync)
        if job.rank == 0:
            print(f"resumed from {latest} (step {start_step})", flush=True)

    def checkpoint(step: int) -> None:
        with job.timers("checkpoint"):
            models.placement.keep(*trainable("policy"))
            save_megatron_checkpoint(models.policy, ckpt_dir / f"step_{step}", optimizer=models.optimizer, step=step,
                                     config=job.resolved_config)

    acc_before, cached = None, False
    if cfg.trainer.eval_before:
        from alignment.trainers.eval_cache import cached_accuracy, heldout_key

        def evaluate_before() -> float:
            return grpo.evaluate(models, heldout, cfg.data.task, cfg.rollout.eval_max_tokens)

        if start_step == 0:  # the base checkpoint: its accuracy may be known from an earlier run
            key = heldout_key(job.hf_dir, models.tokenizer, heldout, cfg, job.world)
            acc_before, cached = cached_accuracy(key, evaluate_before, cfg.trainer.eval_cache)
        else:
            acc_before = evaluate_before()
        job.log({"heldout/accuracy": acc_before}, start_step)
        if job.rank == 0:
            what = f"at step {start_step} (resumed)" if start_step else "before training"
            note = " (cached from an earlier run: trainer.eval_cache)" if cached else ""
            print(f"held-out accuracy {what}: {acc_before:.3f} ({len(heldout)} problems){note}", flush=True)
    startup_s = job.seconds_since_launch()

    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    per_rank = cfg.rollout.prompts_per_step // dp
    steps = job.progress(start_step, cfg.trainer.steps, "grpo")
    for step in steps:
        first = (step * cfg.rollout.prompts_per_step + dp_rank * per_rank) % len(train)
        problems = [train[(first + i) % len(train)] for i in range(per_rank)]
        refill_rng = random.Random(hash((cfg.seed, step, dp_rank)))

        def refill(k: int):  # more training problems for DAPO dynamic sampling
            return [train[refill_rng.randrange(len(train))] for _ in range(k)]

        t0 = time.perf_counter()
        job.profiler.begin(step)
        metrics, times = grpo.grpo_step(models, problems, cfg, refill)
        job.profiler.end(step)
        step_time = time.perf_counter() - t0
        metrics["tokens_per_s"] = metrics.pop("tokens") / step_time
        metrics.update({f"time/{k}": v for k, v in times.items()}, **{"time/step": step_time})
        metrics["memory/peak_rss_gib"] = peak_rss_bytes() / 2**30  # this rank's, so far
        if cfg.trainer.eval_every and (step + 1) % cfg.trainer.eval_every == 0 and step + 1 < cfg.trainer.steps:
            metrics["heldout/accuracy"] = grpo.evaluate(models, heldout, cfg.data.task, cfg.rollout.eval_max_tokens)
        job.log(metrics, step + 1)
        job.history.append(metrics)
        if preemption.stop_requested():  # SIGUSR1/SIGTERM on any rank: save this step, exit 75
            preemption.save_and_exit(job, step + 1, checkpoint, models.engine)
        if cfg.trainer.save_every and (step + 1) % cfg.trainer.save_every == 0 and step + 1 < cfg.trainer.steps:
            checkpoint(step + 1)
        if hasattr(steps, "set_postfix"):
            steps.set_postfix(reward=f"{metrics['reward/mean']:.3f}", kl=f"{metrics['kl']:.4f}",
                              s=f"{step_time:.1f}")

    acc_after = grpo.evaluate(models, heldout, cfg.data.task, cfg.rollout.eval_max_tokens)
    job.log({"heldout/accuracy": acc_after}, cfg.trainer.steps)
    if cfg.trainer.save_checkpoint and start_step < cfg.trainer.steps:
        checkpoint(cfg.trainer.steps)
    if cfg.trainer.export_hf:
        models.placement.keep("policy")
        save_hf_checkpoint(models.policy, models.bridge, job.hf_config, models.tokenizer, job.out / "hf")
    summary = {"heldout_accuracy_before": acc_before, "heldout_before_cached": cached,
               "heldout_accuracy_after": acc_after, "start_step": start_step,
               "heldout_size": len(heldout), "steps": cfg.trainer.steps, "world_size": job.world,
               "startup_s": startup_s, "history": job.history}
    before = f" (before: {acc_before:.3f})" if acc_before is not None else ""
    return job.finish(summary, f"held-out accuracy after training: {acc_after:.3f}{before}", models.engine)


@hydra.main(version_base=None, config_path="../configs", config_name="grpo")
def main(cfg: DictConfig) -> None:
    """Hydra entry point: compose ``configs/grpo.yaml`` (or ``--config-name sft|rm|dpo|...``)
    with command-line overrides and run. Exits with ``launchers.preemption.PREEMPTED_EXIT_CODE``
    (75) when stopped by SIGUSR1/SIGTERM after saving a checkpoint."""
    from launchers.preemption import install

    install()  # as early as possible: a signal before this would kill the process
    if cfg.trainer.quiet:  # before Megatron and vLLM are imported (launchers/console.py)
        from launchers.console import route_third_party_output
        from parallel.state import env_world

        route_third_party_output(Path(cfg.output_dir) / "logs" / f"rank{env_world()[0]}.log")
    run(cfg)


if __name__ == "__main__":
    main()
