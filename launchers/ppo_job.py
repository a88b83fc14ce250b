"""PPO job (``algorithm.name=ppo``), run by ``launchers/train.py --config-name ppo``.

config -> validate -> groups -> policy (from ``model.path``, e.g. the SFT export) + reference,
critic (from ``model.critic_path`` or the reward model) and frozen reward model
(``model.reward_model_path``) + vLLM engine -> held-out greedy responses of the initial
policy, scored by the reward model -> PPO steps on the dpo_en_demo training prompts ->
held-out responses of the trained policy -> win rate (trained vs initial, judged by the
reward model) and response-length drift -> checkpoint + HF export.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist


def build(cfg, hf_dir: Path, hf_config, rank: int):
    """This rank's :class:`alignment.trainers.ppo.PPOModels`."""
    from transformers import AutoConfig

    from alignment.models.families import get_bridge
    from alignment.models.gpt import build_gpt_model
    from alignment.models.hf_assets import prepare_hf_dir
    from alignment.models.value_head import build_value_model
    from alignment.models.weights import lazy_safetensors, load_hf_weights
    from alignment.trainers.megatron_step import OptimConfig, main_param_writer, setup_training
    from alignment.trainers.offload import DevicePlacement, offload_enabled
    from alignment.trainers.ppo import PPOModels
    from launchers.common import job_transformer_config, rollout_engine

    t = cfg.trainer

    def shard(path, value_head: bool, lr: float | None = None):
        """The model at ``path`` (a value model: scalar head), frozen, or with ``lr`` trained: then
        ``(ddp, optimizer)``, the checkpoint also seeding the optimizer's fp32 master weights."""
        path = prepare_hf_dir(path)
        hcfg = AutoConfig.from_pretrained(path)
        tcfg = job_transformer_config(cfg, hcfg)
        model = build_value_model(hcfg, tcfg, seed=cfg.seed) if value_head else build_gpt_model(hcfg, tcfg)
        state = lazy_safetensors(path)
        skip = ("output_layer.weight",) if value_head and "score.weight" not in state else ()
        bridge = get_bridge(hcfg, head="score" if value_head else "lm")
        if lr is None:
            load_hf_weights(model, state, bridge, skip=skip)
            return model.eval().requires_grad_(False)
        ddp, optimizer = setup_training(model, OptimConfig(
            lr=lr, weight_decay=t.weight_decay, clip_grad=t.clip_grad, use_distributed_optimizer=t.use_distributed_optimizer))
        load_hf_weights(model, state, bridge, skip=skip, main_params=main_param_writer(optimizer))
        return ddp, optimizer

    policy, optimizer = shard(cfg.model.path, False, lr=t.lr)
    critic, critic_optimizer = shard(cfg.model.critic_path or cfg.model.reward_model_path, True, lr=t.critic_lr)
    reference = shard(cfg.model.path, False) if cfg.algorithm.kl_coef > 0 else None
    reward_model = shard(cfg.model.reward_model_path, True)
    bridge = get_bridge(hf_config)
    engine, resharder = rollout_engine(cfg, hf_dir, policy, bridge, hf_config.vocab_size, rank)
    placement = DevicePlacement(enabled=offload_enabled(t.offload))
    placement.add_model("policy", policy, optimizer)
    placement.add_model("critic", critic, critic_optimizer)
    placement.add_model("reference", reference)
    placement.add_model("reward_model", reward_model)
    return PPOModels(policy, optimizer, reference, engine, bridge, engine.tokenizer,
                     hf_config.vocab_size, placement, resharder, critic=critic, critic_optimizer=critic_optimizer,
                     reward_model=reward_model)


def prompts_of(cfg, tokenizer, split: str) -> list[list[int]]:
    """Chat-template prompt ids of the dpo_en_demo split, keeping the last ``data.max_prompt_length`` tokens."""
    from alignment.data.chat_data import encode_prompt, load_preference_pairs

    pairs = load_preference_pairs(split, cfg.data.heldout_size, "dpo_en_demo")
    out = [encode_prompt(tokenizer, p.messages)[-cfg.data.max_prompt_length:] for p in pairs]
    return out[: cfg.data.train_size] if split == "train" else out


def heldout_responses(models, prompts: list[list[int]], cfg) -> dict[str, list[float]]:
    """Greedy responses of the current policy to this DP rank's held-out prompts, scored by the
    reward model: ``{"scores": [...], "lengths": [...]}`` (last pipeline stage's values)."""
    from alignment.rollout.base import SamplingConfig
    from alignment.trainers.batching import make_batch
    from alignment.trainers.grpo import generate_for_group, rollout_phase
    from alignment.trainers.ppo import score

    with rollout_phase(models):
        groups = generate_for_group(models.engine, prompts, SamplingConfig(n=1, temperature=0.0,
                                                                           max_tokens=cfg.rollout.max_tokens))
    samples = [g[0] for g in groups]
    batch = make_batch(samples, pad_id=models.tokenizer.pad_token_id or 0)
    batch["prompt_lengths"] = torch.tensor([len(s.prompt_ids) for s in samples])
    models.placement.keep("reward_model")
    scores = score(models.reward_model, batch, cfg)
    return {"scores": scores.tolist(), "lengths": [float(len(s.response_ids)) for s in samples]}


def compare(before: dict, after: dict) -> dict[str, float]:
    """Global win rate of ``after`` over ``before`` (ties count half) and mean score and length
    of both; each DP rank's held-out prompts counted once (collective)."""
    from alignment.trainers.megatron_step import all_reduce_sum, is_output_rank

    keep = 1.0 if is_output_rank() else 0.0
    sb, sa = torch.tensor(before["scores"]), torch.tensor(after["scores"])
    wins = ((sa > sb).float() + 0.5 * (sa == sb).float()).sum().item()
    n, w, rb, ra, lb, la = all_reduce_sum([keep * v for v in [
        float(len(sb)), wins, sb.sum().item(), sa.sum().item(), sum(before["lengths"]), sum(after["lengths"])]])
    return {"win_rate": w / n, "reward_before": rb / n, "reward_after": ra / n,
            "length_before": lb / n, "length_after": la / n, "prompts": n}


def run(cfg) -> dict:
    """Run a PPO job; returns the summary written to ``<output_dir>/summary.json``."""
    from megatron.core import parallel_state as ps

    from alignment.trainers.checkpoint import (
        latest_checkpoint,
        load_megatron_checkpoint,
        save_hf_checkpoint,
        save_megatron_checkpoint,
    )
    from alignment.trainers.grpo import sync_weights
    from alignment.trainers.offload import trainable
    from alignment.trainers.ppo import ppo_step
    from launchers import preemption
    from launchers.common import start

    job = start(cfg)  # validates the config before any process group starts
    models = build(cfg, job.hf_dir, job.hf_config, job.rank)
    train, heldout = prompts_of(cfg, models.tokenizer, "train"), prompts_of(cfg, models.tokenizer, "heldout")
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    my_heldout = heldout[: len(heldout) // dp * dp][dp_rank::dp]

    # The initial (SFT) policy's held-out responses are the baseline of the win rate: generated
    # before a resume loads trained weights (into the policy, which rollout.backend=megatron runs)
    baseline = heldout_responses(models, my_heldout, cfg)
    ckpt_dir, start_step = job.out / "checkpoints", 0
    latest = latest_checkpoint(ckpt_dir) if cfg.trainer.resume else None
    if latest is not None:  # policy and critic (with their Adam states) resume together
        models.placement.keep(*trainable("policy"), *trainable("critic"))
        start_step = load_megatron_checkpoint(models.policy, latest / "policy", models.optimizer)
        load_megatron_checkpoint(models.critic, latest / "critic", models.critic_optimizer)
        if job.rank == 0:
            print(f"resumed from {latest} (step {start_step})", flush=True)
    if latest is not None:
        models.placement.keep("policy")
        sync_weights(models, cfg.rollout.check_weight_sync)

    def checkpoint(step: int) -> None:
        with job.timers("checkpoint"):
            final, parts = ckpt_dir / f"step_{step}", ckpt_dir / f"step_{step}.parts"
            models.placement.keep(*trainable("policy"), *trainable("critic"))
            for name, model, opt in (("policy", models.policy, models.optimizer),
                                     ("critic", models.critic, models.critic_optimizer)):
                save_megatron_checkpoint(model, parts / name, optimizer=opt, step=step, config=job.resolved_config)
            if job.rank == 0:  # both parts complete: publish them together, then mark the step complete
                os.replace(parts, final)
                (final / "metadata.json").write_text(json.dumps({"step": step}))
            dist.barrier()

    per_rank = cfg.rollout.prompts_per_step // dp
    steps = job.progress(start_step, cfg.trainer.steps, "ppo")
    for step in steps:
        first = (step * cfg.rollout.prompts_per_step + dp_rank * per_rank) % len(train)
        prompts = [train[(first + i) % len(train)] for i in range(per_rank)]
        t0 = time.perf_counter()
        job.profiler.begin(step)
        metrics, times = ppo_step(models, prompts, cfg)
        job.profiler.end(step)
        metrics.update({f"time/{k}": v for k, v in times.items()}, **{"time/step": time.perf_counter() - t0})
        job.log(metrics, step + 1)
        job.history.append(metrics)
        if preemption.stop_requested():  # SIGUSR1/SIGTERM on any rank: save this step, exit 75
            preemption.save_and_exit(job, step + 1, checkpoint, models.engine)
        if cfg.trainer.save_every and (step + 1) % cfg.trainer.save_every == 0 and step + 1 < cfg.trainer.steps:
            checkpoint(step + 1)
        if hasattr(steps, "set_postfix"):
            steps.set_postfix(reward=f"{metrics['reward/mean']:.3f}", kl=f"{metrics['kl']:.4f}")

    result = compare(baseline, heldout_responses(models, my_heldout, cfg))
    job.log({f"heldout/{k}": v for k, v in result.items()}, cfg.trainer.steps)
    if cfg.trainer.save_checkpoint and start_step < cfg.trainer.steps:
        checkpoint(cfg.trainer.steps)
    if cfg.trainer.export_hf:
        models.placement.keep("policy")
        save_hf_checkpoint(models.policy, models.bridge, job.hf_config, models.tokenizer, job.out / "hf")
    summary = {"heldout": result, "start_step": start_step, "steps": cfg.trainer.steps, "world_size": job.world,
               "history": job.history}
    return job.finish(summary, f"held-out (reward model judge): {json.dumps(result)}", models.engine)
