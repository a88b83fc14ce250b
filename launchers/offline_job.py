"""SFT, reward-model, DPO and process-reward-model jobs (``algorithm.name`` = sft | rm | dpo | prm),
run by ``launchers/train.py`` with ``--config-name sft|rm|dpo|prm``.

config -> validate -> groups -> tokenise the dataset -> build the model (LM, or scalar-head
reward model) and, for the DPO family, a frozen reference -> resume -> held-out metrics ->
steps over shuffled global batches -> held-out metrics -> checkpoint + HF export.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch


def make_objective(cfg, vocab_size: int):
    """The loss function object for ``cfg.algorithm`` (:mod:`alignment.trainers.sft` / ``reward_model`` /
    ``dpo`` / ``process_reward``)."""
    from alignment.trainers.dpo import DPOObjective
    from alignment.trainers.process_reward import ProcessRewardObjective
    from alignment.trainers.reward_model import RewardModelObjective
    from alignment.trainers.sft import SFTObjective

    a = cfg.algorithm
    if a.name == "sft":
        return SFTObjective(vocab_size)
    if a.name == "rm":
        return RewardModelObjective(center_coef=a.center_coef)
    if a.name == "prm":
        return ProcessRewardObjective()
    return DPOObjective(vocab_size, beta=a.beta, loss_type=a.loss_type, label_smoothing=a.label_smoothing,
                        simpo_gamma=a.simpo_gamma, orpo_lambda=a.orpo_lambda)


def build(cfg, hf_dir: Path, hf_config, objective):
    """This rank's trained shard (DDP + optimizer; with ``model.lora`` its adapters, and a reward
    model's scalar head, only trained) and the frozen reference when needed (with LoRA the trained
    shard with its adapters off)."""
    from transformers import AutoTokenizer

    from alignment.models.families import get_bridge
    from alignment.models.gpt import build_gpt_model
    from alignment.models.value_head import build_value_model
    from alignment.models.weights import lazy_safetensors, load_hf_weights
    from alignment.trainers.offline import OfflineModels
    from alignment.training.megatron_step import OptimConfig, main_param_writer, setup_training
    from launchers.common import add_adapters, job_transformer_config
    from parallel.lora import FrozenBase

    hf_state = lazy_safetensors(hf_dir)
    tcfg = lambda: job_transformer_config(cfg, hf_config)  # noqa: E731
    skip = ()
    if objective.value_head:
        bridge = get_bridge(hf_config, head="score")
        model = build_value_model(hf_config, tcfg(), seed=cfg.seed)
        # A causal-LM checkpoint has no score head: keep the fresh one.
        skip = () if "score.weight" in hf_state else ("output_layer.weight",)
    else:
        bridge = get_bridge(hf_config)
        model = build_gpt_model(hf_config, tcfg())
    lora = add_adapters(cfg, model, head=objective.value_head)
    ddp, optimizer = setup_training(model, OptimConfig(
        lr=cfg.trainer.lr, weight_decay=cfg.trainer.weight_decay, clip_grad=cfg.trainer.clip_grad,
        use_distributed_optimizer=cfg.trainer.use_distributed_optimizer))
    load_hf_weights(model, hf_state, bridge, skip=skip, main_params=main_param_writer(optimizer))
    reference = None
    if objective.needs_reference and lora:
        reference = FrozenBase(ddp)  # the base weights with the adapters off: no second copy
    elif objective.needs_reference:
        reference = build_gpt_model(hf_config, tcfg()).eval()
        load_hf_weights(reference, hf_state, bridge)
        reference.requires_grad_(False)
    return OfflineModels(ddp, optimizer, reference, bridge, AutoTokenizer.from_pretrained(hf_dir))


def export_config(cfg, hf_config, tokenizer, bridge):
    """The HF config written with the export: a sequence classifier (``score`` head, the family's
    ``*ForSequenceClassification``) for a reward model."""
    if cfg.algorithm.name not in ("rm", "prm"):
        return hf_config
    out = type(hf_config).from_dict(hf_config.to_dict())
    out.architectures = [bridge.hf_architecture]
    out.num_labels = 1
    # HF pools at the last token that is not ``pad_token_id``; our score is read at the real
    # last token, which is the EOS. So the exported pad id must not be the EOS (SmolLM2 pads
    # with <|im_end|>): use the tokenizer's pad, else its unk, else id 0, whichever is not EOS.
    candidates = [tokenizer.pad_token_id, tokenizer.unk_token_id, 0]
    out.pad_token_id = next(c for c in candidates if c is not None and c != tokenizer.eos_token_id)
    return out


def run(cfg) -> dict:
    """Run an SFT / RM / DPO job; returns the summary written to ``<output_dir>/summary.json``."""
    from megatron.core import parallel_state as ps

    from alignment.data.examples import tokenize_split
    from alignment.trainers import offline
    from alignment.training.batching import MicroBatching
    from alignment.training.checkpoint import (
        latest_checkpoint,
        load_megatron_checkpoint,
        save_hf_checkpoint,
        save_megatron_checkpoint,
    )
    from alignment.training.dp_balance import global_batch_share
    from alignment.training.health import HealthMonitor
    from launchers import preemption
    from launchers.common import export_adapters, start
    from parallel.state import replica_group

    job = start(cfg)  # validates the config before any process group starts
    objective = make_objective(cfg, job.hf_config.vocab_size)
    models = build(cfg, job.hf_dir, job.hf_config, objective)
    tok = models.tokenizer
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    train, heldout = tokenize_split(cfg, tok, "train"), tokenize_split(cfg, tok, "heldout")
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    mbs = cfg.trainer.micro_batch_size
    rows_per_mb = MicroBatching.from_trainer(cfg.trainer, objective.rows_per_example)

    def batch_of(examples) -> dict:
        rows = [r for e in examples for r in e]
        batch = offline.build_batch([r[:2] for r in rows], pad, models, objective, rows_per_mb)
        if hasattr(objective, "add_targets"):  # the PRM's step labels
            objective.add_targets(batch, rows)
        return batch

    if len(heldout) < dp:  # the PRM keeps only the solutions with a labelled step
        raise ValueError(f"{len(heldout)} held-out examples for {dp} data-parallel ranks: data.dataset={cfg.data.dataset}"
                         f" needs at least {dp} (with a labelled step within data.max_length for the PRM)")
    mine = heldout[: len(heldout) // dp * dp][dp_rank::dp]
    heldout_batches = [batch_of(mine[i : i + mbs]) for i in range(0, len(mine), mbs)]
    evaluate = lambda: offline.evaluate(models, objective, heldout_batches, rows_per_mb)  # noqa: E731

    gbs = cfg.trainer.global_batch_size
    steps_per_epoch = len(train) // gbs
    if steps_per_epoch == 0:
        raise ValueError(f"trainer.global_batch_size={gbs} exceeds the {len(train)} training examples")
    total = steps_per_epoch * cfg.trainer.epochs
    total = min(total, cfg.trainer.steps) if cfg.trainer.steps else total
    ckpt_dir, start_step = job.out / "checkpoints", 0
    latest = latest_checkpoint(ckpt_dir) if cfg.trainer.resume else None
    if latest is not None:
        start_step = load_megatron_checkpoint(models.model, latest, models.optimizer)
        if job.rank == 0:
            print(f"resumed from {latest} (step {start_step})", flush=True)

    def checkpoint(step: int) -> None:
        with job.timers("checkpoint"):
            save_megatron_checkpoint(models.model, ckpt_dir / f"step_{step}", optimizer=models.optimizer, step=step,
                                     config=job.resolved_config)

    before = None
    if cfg.trainer.eval_before:
        before = evaluate()
        job.log({f"heldout/{k}": v for k, v in before.items()}, start_step)
        if job.rank == 0:
            print(f"held-out before ({len(mine) * dp} examples): {json.dumps(before)}", flush=True)
    startup_s = job.seconds_since_launch()

    health = HealthMonitor(cfg.trainer, job.rank)  # NaN/inf updates, trainer.warn_on / stop_on
    steps = job.progress(start_step, total, cfg.algorithm.name)
    for step in steps:
        job.profiler.begin(step)
        epoch, k = divmod(step, steps_per_epoch)  # a fresh shuffle per epoch, the same on every rank
        order = torch.randperm(len(train), generator=torch.Generator().manual_seed(cfg.seed + epoch)).tolist()
        step_idx = order[k * gbs : (k + 1) * gbs]
        share, imbalance = global_batch_share([sum(len(r[0]) for r in train[i]) for i in step_idx], dp, dp_rank,
                                             cfg.trainer.balance_batch)
        idx = [step_idx[j] for j in share]
        t0 = time.perf_counter()
        batch = batch_of([train[i] for i in idx])
        every = cfg.trainer.grad_stats_every
        models.grad_norms = {} if every and (step + 1) % every == 0 else None
        metrics = offline.train_step(models, objective, batch, rows_per_mb)
        metrics.update(models.grad_norms or {})
        leader = replica_group().rank() == 0
        real = batch["input_ids"] != pad
        tokens, rows = offline.all_reduce_sum([float(real.sum()) if leader else 0.0,
                                              float(real.any(-1).sum()) if leader else 0.0], None)
        dt = time.perf_counter() - t0
        job.profiler.end(step)
        metrics.update({"time/train": dt, "time/step": dt, "tokens_per_s": tokens / dt, "seq_length": tokens / rows,
                        "dp_token_imbalance": imbalance, "epoch": epoch + (k + 1) / steps_per_epoch})
        stop = health.check(step + 1, metrics)
        job.log({f"train/{name}": v for name, v in metrics.items()}, step + 1)
        job.history.append(metrics)
        if stop:
            checkpoint(step + 1)
            raise health.error(str(ckpt_dir / f"step_{step + 1}"))
        if cfg.trainer.eval_every and (step + 1) % cfg.trainer.eval_every == 0 and step + 1 < total:
            job.log({f"heldout/{name}": v for name, v in evaluate().items()}, step + 1)
        if preemption.stop_requested():  # SIGUSR1/SIGTERM on any rank: save this step, exit 75
            preemption.save_and_exit(job, step + 1, checkpoint)
        if cfg.trainer.save_every and (step + 1) % cfg.trainer.save_every == 0 and step + 1 < total:
            checkpoint(step + 1)
        if hasattr(steps, "set_postfix"):
            steps.set_postfix(loss=f"{metrics['loss']:.4f}", s=f"{dt:.1f}")
    after = evaluate()
    job.log({f"heldout/{k}": v for k, v in after.items()}, total)
    if cfg.trainer.save_checkpoint and start_step < total:
        checkpoint(total)
    if cfg.trainer.export_hf:
        save_hf_checkpoint(models.model, models.bridge, export_config(cfg, job.hf_config, tok, models.bridge), tok,
                           job.out / "hf")
        if not objective.value_head:  # a reward model's adapters need its new head: the merged export only
            export_adapters(job, models.model, models.bridge)
    summary = {"heldout_before": before, "heldout_after": after, "start_step": start_step, "steps": total,
               "heldout_size": len(mine) * dp, "train_size": len(train), "world_size": job.world,
               "startup_s": startup_s, "history": job.history}
    return job.finish(summary, f"held-out after: {json.dumps(after)}")
