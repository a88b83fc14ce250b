"""SFT, reward-model and DPO jobs (``algorithm.name`` = sft | rm | dpo), run by
``launchers/train.py`` with ``--config-name sft|rm|dpo``.

config -> validate -> groups -> tokenise the dataset -> build the model (LM, or scalar-head
reward model) and, for the DPO family, a frozen reference -> resume -> held-out metrics ->
steps over shuffled global batches -> held-out metrics -> checkpoint + HF export.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from omegaconf import OmegaConf


def make_objective(cfg, vocab_size: int):
    """The loss function object for ``cfg.algorithm`` (:mod:`alignment.trainers.sft` / ``reward_model`` / ``dpo``)."""
    from alignment.trainers.dpo import DPOObjective
    from alignment.trainers.reward_model import RewardModelObjective
    from alignment.trainers.sft import SFTObjective

    a = cfg.algorithm
    if a.name == "sft":
        return SFTObjective(vocab_size)
    if a.name == "rm":
        return RewardModelObjective(center_coef=a.center_coef)
    return DPOObjective(vocab_size, beta=a.beta, loss_type=a.loss_type, label_smoothing=a.label_smoothing,
                        simpo_gamma=a.simpo_gamma, orpo_lambda=a.orpo_lambda)


def tokenize_split(cfg, tokenizer, split: str) -> list[list[tuple[list[int], int]]]:
    """Per example, its rows ``(ids, prompt_len)``: one for SFT, ``[chosen, rejected]`` for pairs."""
    from alignment.data.chat_data import encode_example, load_preference_pairs, load_sft_examples

    d = cfg.data
    enc = lambda msgs, resp: encode_example(tokenizer, msgs, resp, d.max_length, d.max_prompt_length)  # noqa: E731
    if cfg.algorithm.name == "sft":
        examples = load_sft_examples(split, d.heldout_size, d.dataset)
        out = [[enc(e.messages, e.response)] for e in examples]
    else:
        pairs = load_preference_pairs(split, d.heldout_size, d.dataset)
        out = [[enc(p.messages, p.chosen), enc(p.messages, p.rejected)] for p in pairs]
    return out[: d.train_size] if split == "train" else out


def build(cfg, hf_dir: Path, hf_config, objective):
    """This rank's trained shard (DDP + optimizer) and the frozen reference when needed."""
    from transformers import AutoTokenizer

    from alignment.models.bridges.llama import get_bridge
    from alignment.models.gpt import build_gpt_model, transformer_config
    from alignment.models.value_head import build_value_model
    from alignment.models.weights import lazy_safetensors, load_hf_weights
    from alignment.trainers.megatron_step import OptimConfig, setup_training
    from alignment.trainers.offline import OfflineModels

    dtype = getattr(torch, cfg.model.dtype)
    hf_state = lazy_safetensors(hf_dir)
    tcfg = lambda: transformer_config(hf_config, params_dtype=dtype, **cfg.parallel)  # noqa: E731
    if objective.value_head:
        bridge = get_bridge(hf_config, head="score")
        model = build_value_model(hf_config, tcfg(), seed=cfg.seed)
        # A causal-LM checkpoint has no score head: keep the fresh one.
        load_hf_weights(model, hf_state, bridge, skip=() if "score.weight" in hf_state else ("output_layer.weight",))
    else:
        bridge = get_bridge(hf_config)
        model = build_gpt_model(hf_config, tcfg())
        load_hf_weights(model, hf_state, bridge)
    ddp, optimizer = setup_training(model, OptimConfig(
        lr=cfg.trainer.lr, weight_decay=cfg.trainer.weight_decay, clip_grad=cfg.trainer.clip_grad,
        use_distributed_optimizer=cfg.trainer.use_distributed_optimizer))
    reference = None
    if objective.needs_reference:
        reference = build_gpt_model(hf_config, tcfg()).eval()
        load_hf_weights(reference, hf_state, bridge)
        reference.requires_grad_(False)
    return OfflineModels(ddp, optimizer, reference, bridge, AutoTokenizer.from_pretrained(hf_dir))


def export_config(cfg, hf_config, tokenizer):
    """The HF config written with the export: a sequence classifier (``score`` head) for a reward model."""
    if cfg.algorithm.name != "rm":
        return hf_config
    out = type(hf_config).from_dict(hf_config.to_dict())
    out.architectures = ["LlamaForSequenceClassification"]
    out.num_labels = 1
    # HF pools at the last token that is not ``pad_token_id``; our score is read at the real
    # last token, which is the EOS. So the exported pad id must not be the EOS (SmolLM2 pads
    # with <|im_end|>): use the tokenizer's pad, else its unk, else id 0, whichever is not EOS.
    candidates = [tokenizer.pad_token_id, tokenizer.unk_token_id, 0]
    out.pad_token_id = next(c for c in candidates if c is not None and c != tokenizer.eos_token_id)
    return out


def run(cfg) -> dict:
    """Run an SFT / RM / DPO job; returns the summary written to ``<output_dir>/summary.json``."""
    from transformers import AutoConfig

    from alignment.config import validate
    from alignment.models.hf_assets import prepare_hf_dir
    from alignment.trainers import offline
    from alignment.trainers.checkpoint import (
        latest_checkpoint,
        load_megatron_checkpoint,
        save_hf_checkpoint,
        save_megatron_checkpoint,
    )
    from parallel.layout import ParallelLayout
    from parallel.state import env_world, init_distributed, shutdown

    rank, world, _ = env_world()
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
    objective = make_objective(cfg, hf_config.vocab_size)
    models = build(cfg, hf_dir, hf_config, objective)
    tok = models.tokenizer
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    train, heldout = tokenize_split(cfg, tok, "train"), tokenize_split(cfg, tok, "heldout")
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    rows_per_mb = cfg.trainer.micro_batch_size * objective.rows_per_example

    def batch_of(examples) -> dict:
        rows = [r for e in examples for r in e]
        return offline.build_batch(rows, pad, models, objective, rows_per_mb)

    mine = heldout[: len(heldout) // dp * dp][dp_rank::dp]
    heldout_batches = [batch_of(mine[i : i + cfg.trainer.micro_batch_size])
                       for i in range(0, len(mine), cfg.trainer.micro_batch_size)]

    def log(values: dict, step: int):
        if writer is not None:
            for k, v in values.items():
                writer.add_scalar(k, v, step)
            writer.flush()

    gbs = cfg.trainer.global_batch_size
    steps_per_epoch = len(train) // gbs
    if steps_per_epoch == 0:
        raise ValueError(f"trainer.global_batch_size={gbs} exceeds the {len(train)} training examples")
    total = steps_per_epoch * cfg.trainer.epochs
    total = min(total, cfg.trainer.steps) if cfg.trainer.steps else total
    ckpt_dir, start_step = out / "checkpoints", 0
    latest = latest_checkpoint(ckpt_dir) if cfg.trainer.resume else None
    if latest is not None:
        start_step = load_megatron_checkpoint(models.model, latest, models.optimizer)
    before = offline.evaluate(models, objective, heldout_batches, rows_per_mb)
    log({f"heldout/{k}": v for k, v in before.items()}, start_step)
    if rank == 0:
        print(f"held-out before ({len(mine) * dp} examples): {json.dumps(before)}", flush=True)

    steps = range(start_step, total)
    if rank == 0 and cfg.trainer.progress_bar:
        from tqdm import tqdm

        steps = tqdm(steps, desc=cfg.algorithm.name, dynamic_ncols=True, initial=start_step, total=total)
    history = []
    per_rank = gbs // dp
    for step in steps:
        epoch, k = divmod(step, steps_per_epoch)
        order = torch.randperm(len(train), generator=torch.Generator().manual_seed(cfg.seed + epoch)).tolist()
        idx = order[k * gbs + dp_rank * per_rank : k * gbs + (dp_rank + 1) * per_rank]
        t0 = time.perf_counter()
        batch = batch_of([train[i] for i in idx])
        metrics = offline.train_step(models, objective, batch, rows_per_mb)
        tokens = offline._all_reduce([float((batch["input_ids"] != pad).sum()) if
                                      ps.get_model_parallel_group().rank() == 0 else 0.0], None)[0]
        dt = time.perf_counter() - t0
        metrics.update({"time/step": dt, "tokens_per_s": tokens / dt, "epoch": epoch + (k + 1) / steps_per_epoch})
        log({f"train/{k_}": v for k_, v in metrics.items()}, step + 1)
        history.append(metrics)
        if cfg.trainer.eval_every and (step + 1) % cfg.trainer.eval_every == 0 and step + 1 < total:
            log({f"heldout/{k_}": v for k_, v in offline.evaluate(models, objective, heldout_batches,
                                                                   rows_per_mb).items()}, step + 1)
        if cfg.trainer.save_every and (step + 1) % cfg.trainer.save_every == 0 and step + 1 < total:
            save_megatron_checkpoint(models.model, ckpt_dir / f"step_{step + 1}", optimizer=models.optimizer,
                                     step=step + 1)
        if rank == 0 and hasattr(steps, "set_postfix"):
            steps.set_postfix(loss=f"{metrics['loss']:.4f}", s=f"{dt:.1f}")
    after = offline.evaluate(models, objective, heldout_batches, rows_per_mb)
    log({f"heldout/{k}": v for k, v in after.items()}, total)
    if cfg.trainer.save_checkpoint and start_step < total:
        save_megatron_checkpoint(models.model, ckpt_dir / f"step_{total}", optimizer=models.optimizer, step=total)
    if cfg.trainer.export_hf:
        save_hf_checkpoint(models.model, models.bridge, export_config(cfg, hf_config, tok), tok, out / "hf")
    summary = {"heldout_before": before, "heldout_after": after, "start_step": start_step, "steps": total,
               "heldout_size": len(mine) * dp, "train_size": len(train), "world_size": world, "history": history}
    if rank == 0:
        print(f"held-out after: {json.dumps(after)}", flush=True)
        (out / "summary.json").write_text(json.dumps(summary, indent=1, default=float))
        writer.close()
    dist.barrier()
    shutdown()
    return summary

