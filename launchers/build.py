"""One builder for every job's models: :func:`build_models` gives this rank's
:class:`alignment.trainers.models.Models` for the roles a job names (the trained policy, PPO's
critic, the frozen reference, reward model and process reward model, the rollout engine), each role
built the same way in every job (:func:`load_model`), in one fixed order."""

from __future__ import annotations

from collections.abc import Collection
from pathlib import Path

import torch
import torch.distributed as dist

from alignment.algorithms.config import routing_replay
from alignment.config import parallel_sizes
from alignment.models.config import lora_spec
from alignment.models.families import get_bridge, text_config
from alignment.models.gpt import build_gpt_model, transformer_config
from alignment.models.hf_assets import prepare_hf_dir
from alignment.models.value_head import build_value_model
from alignment.models.weights import lazy_safetensors, load_hf_weights
from alignment.rollout.engines.disaggregated import RemoteEngine
from alignment.rollout.engines.factory import build_engine, eos_token_ids
from alignment.rollout.engines.megatron_engine import MegatronEngine
from alignment.rollout.episodes.multi_turn import episode_setup
from alignment.trainers.agent_rollout import setup_agents, uses_agents
from alignment.trainers.models import Models
from alignment.training.megatron_step import OptimConfig, main_param_writer, setup_training
from alignment.training.offload import DevicePlacement, offload_enabled
from launchers.input_checks import image_processor
from parallel.lora import FrozenBase, apply_lora
from parallel.reshard import Resharder
from parallel.state import trainer_rollout_group

#: what a job can ask :func:`build_models` for, in the order they are built
ROLES = ("policy", "critic", "reference", "teacher", "reward_model", "process_reward_model", "engine")


def build_models(cfg, job, roles: Collection[str], value_policy: bool = False):
    """This rank's :class:`alignment.trainers.models.Models` for a job (``job``: the
    :class:`launchers.common.Run`; its ``hf_dir`` holds the initial policy) with ``roles`` (of
    :data:`ROLES`, built in that order whatever the order given):

    - ``policy``: trained at ``trainer.lr`` from ``job.hf_dir`` (``value_policy``: a scalar-head
      model, the reward-model and PRM jobs'); with ``model.lora`` its adapters only.
    - ``critic``: PPO's value model from ``model.critic_path`` (else the reward model), trained at
      ``trainer.critic_lr``.
    - ``reference``: the frozen initial policy; with ``model.lora`` the policy with its adapters
      off (:class:`parallel.lora.FrozenBase`, no second copy).
    - ``teacher``: on-policy distillation's frozen teacher from ``model.teacher_path``, at the policy's
      layout (any supported family; the same tokenizer, checked before start).
    - ``reward_model`` / ``process_reward_model``: frozen scalar-head models from
      ``model.reward_model_path`` / ``reward.process_reward_model``.
    - ``engine``: the rollout engine (``rollout.backend``) and its resharder; without it the
      tokenizer is ``job.hf_dir``'s.

    Raises:
        ValueError: a role not in :data:`ROLES`, or no ``policy``.
    """
    from transformers import AutoTokenizer

    unknown = set(roles) - set(ROLES)
    if unknown or "policy" not in roles:
        raise ValueError(f"build_models roles {sorted(roles)}: each of {ROLES}, policy among them")
    t, hf_dir = cfg.trainer, job.hf_dir
    policy, optimizer = load_model(cfg, hf_dir, value_policy, lr=t.lr)
    critic = critic_optimizer = reference = teacher = reward_model = prm = None
    if "critic" in roles:
        critic, critic_optimizer = load_model(cfg, cfg.model.critic_path or cfg.model.reward_model_path, True,
                                              lr=t.critic_lr)
    if "reference" in roles:
        reference = FrozenBase(policy) if cfg.model.lora.rank else load_model(cfg, hf_dir, value_policy)
    if "teacher" in roles:
        teacher = load_model(cfg, cfg.model.teacher_path, False)
    if "reward_model" in roles:
        reward_model = load_model(cfg, cfg.model.reward_model_path, True)
    if "process_reward_model" in roles:
        prm = load_model(cfg, cfg.reward.process_reward_model, True)
    bridge = get_bridge(job.hf_config, head="score" if value_policy else "lm")
    engine = resharder = episodes = None
    if "engine" in roles:
        engine, resharder = rollout_engine(cfg, hf_dir, policy, bridge, text_config(job.hf_config).vocab_size, job.rank)
        tokenizer = engine.tokenizer
        episodes = episode_setup(cfg, hf_dir, tokenizer, image_processor(hf_dir, job.hf_config))
    else:
        tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    placement = DevicePlacement(enabled=offload_enabled(t.offload))
    for name, model, opt in (("policy", policy, optimizer), ("critic", critic, critic_optimizer),
                             ("reference", reference, None), ("teacher", teacher, None),
                             ("reward_model", reward_model, None),
                             ("process_reward_model", prm, None)):
        placement.add_model(name, model, opt)  # None: skipped
    teacher_engine = None
    if teacher is not None and cfg.algorithm.distill_samples == "teacher":  # the teacher answers (off-policy KD)
        teacher_engine = teacher_rollout_engine(cfg, teacher, tokenizer, hf_dir, text_config(job.hf_config).vocab_size)
    models = Models(policy, optimizer, reference, engine, bridge, tokenizer, text_config(job.hf_config).vocab_size, placement,
                    resharder, reward_model, prm, critic, critic_optimizer, episodes, teacher=teacher,
                    teacher_engine=teacher_engine)
    if engine is not None and uses_agents(cfg):  # the rollout server is up before any agent starts
        models.agents = setup_agents(models, cfg)
    return models


def teacher_rollout_engine(cfg, teacher, tokenizer, hf_dir: Path, vocab_size: int) -> MegatronEngine:
    """Megatron's engine on the teacher's own shards (``algorithm.distill_samples=teacher``): the policy's
    tokenizer and end-of-sequence ids (the two share a tokenizer, checked before start), a KV cache for one
    step's rows per data-parallel rank, its own sampling stream per replica."""
    from megatron.core import parallel_state as ps
    from megatron.core.utils import unwrap_model

    r = cfg.rollout
    rows = max(1, r.prompts_per_step * r.group_size // ps.get_data_parallel_world_size())
    return MegatronEngine(unwrap_model(teacher), tokenizer, eos_token_id=eos_token_ids(hf_dir, tokenizer),
                          vocab_size=vocab_size, max_model_len=r.max_model_len, max_batch_size=rows,
                          seed=cfg.seed + 7919 + ps.get_data_parallel_rank())


def job_transformer_config(cfg, hf_config):
    """Megatron ``TransformerConfig`` of a job's model: ``parallel.*`` sizes, ``model.dtype``
    weights, and for mixture-of-experts models ``model.moe_aux_loss_coeff`` (null: the HF
    config's ``router_aux_loss_coef``). No random initialisation: a job loads every weight from its
    checkpoint (a new scalar head initialises itself). See :func:`alignment.models.gpt.transformer_config`."""

    coeff = cfg.model.moe_aux_loss_coeff
    if coeff is None:
        coeff = float(getattr(hf_config, "router_aux_loss_coef", 0.0) or 0.0)
    return transformer_config(hf_config, params_dtype=getattr(torch, cfg.model.dtype), moe_aux_loss_coeff=coeff,
                              initialize=False,
                              **parallel_sizes(cfg.parallel))


def add_adapters(cfg, model, head: bool = False) -> bool:
    """``model.lora`` (rank > 0): LoRA adapters on ``model``'s linears, every other weight frozen
    (:func:`parallel.lora.apply_lora`), a value model's scalar head (``head``: ``output_layer``)
    kept trainable. Call before :func:`alignment.training.megatron_step.setup_training`. Returns
    whether adapters were added (then the job's reference is :class:`parallel.lora.FrozenBase`)."""

    spec = lora_spec(cfg.model.lora, cfg.seed)
    if spec is None:
        return False
    apply_lora(model, spec)
    if head:
        for name, p in model.named_parameters():
            if name.startswith("output_layer."):
                p.requires_grad_(True)
    return True


def load_model(cfg, path, value_head: bool, lr: float | None = None):
    """The model at ``path`` (an HF directory; ``value_head``: a scalar-head value model, e.g. a
    reward model or a critic) as this rank's shard: frozen (``lr`` None: eval mode, no gradients),
    or trained with Adam at ``lr``: then ``(ddp, optimizer)``, the checkpoint also seeding the
    optimizer's fp32 master weights (with ``model.lora``: adapters, and a value model's head,
    trained; the rest frozen). A value model from a causal-LM checkpoint gets a new head."""
    from transformers import AutoConfig

    t = cfg.trainer
    path = prepare_hf_dir(path, revision=cfg.model.revision if str(path) == str(cfg.model.path) else None)
    hcfg = AutoConfig.from_pretrained(path)
    tcfg = job_transformer_config(cfg, hcfg)
    model = build_value_model(hcfg, tcfg, seed=cfg.seed) if value_head else build_gpt_model(hcfg, tcfg)
    state = lazy_safetensors(path)
    skip = ("output_layer.weight",) if value_head and "score.weight" not in state else ()
    bridge = get_bridge(hcfg, head="score" if value_head else "lm")
    if lr is None:
        load_hf_weights(model, state, bridge, skip=skip)
        return model.eval().requires_grad_(False)
    add_adapters(cfg, model, head=value_head)
    ddp, optimizer = setup_training(model, OptimConfig(lr=lr, weight_decay=t.weight_decay, clip_grad=t.clip_grad,
                                                       use_distributed_optimizer=t.use_distributed_optimizer))
    load_hf_weights(model, state, bridge, skip=skip, main_params=main_param_writer(optimizer))
    return ddp, optimizer


def rollout_layout(bridge, cfg):
    """The resharder's target layout (:meth:`alignment.models.bridge.Bridge.vllm_layout`) for this
    job's training TP (and expert TP) and its engines' ``rollout.tensor_parallel_size``."""
    p = cfg.parallel
    return bridge.vllm_layout(p.tensor_model_parallel_size, cfg.rollout.tensor_parallel_size,
                              p.expert_tensor_parallel_size)


def rollout_engine(cfg, hf_dir: Path, policy, bridge, vocab_size: int, rank: int):
    """This rank's rollout engine (``rollout.backend``, :func:`alignment.rollout.engines.factory.build_engine`)
    and, when the engine keeps its own weights, the resharder that feeds it after every update
    (``None`` when it runs the policy's own). In a disaggregated job (``rollout.placement``) a
    trainer's engine is the rollout ranks' (:class:`alignment.rollout.engines.disaggregated.RemoteEngine`),
    fed over the group that joins them."""
    from megatron.core import parallel_state as ps

    group = trainer_rollout_group()
    if group is not None:
        from transformers import AutoTokenizer

        within_step = cfg.rollout.partial and not cfg.rollout.partial_carry_over  # carried: the engines' pools
        engine = RemoteEngine(group, AutoTokenizer.from_pretrained(hf_dir), trainers=dist.get_world_size(),
                              partial_chunk_tokens=cfg.rollout.partial_chunk_tokens if within_step else 0,
                              carry=cfg.rollout.partial_carry_over)
        return engine, Resharder(policy, rollout_layout(bridge, cfg), vllm_tp=cfg.rollout.tensor_parallel_size,
                                 bucket_bytes=cfg.rollout.sync_bucket_mb << 20, group=group)

    engine = build_engine(cfg.rollout, seed=cfg.seed, dtype=cfg.model.dtype, hf_dir=hf_dir, policy=policy,
                          vocab_size=vocab_size, rank=rank, data_parallel_size=ps.get_data_parallel_world_size(),
                          record_routing=routing_replay(cfg.algorithm) == "r3", steps=cfg.trainer.steps)
    if rank == 0 and getattr(engine, "compile_note", None):
        print(engine.compile_note, flush=True)
    if engine.shares_trainer_weights:
        return engine, None
    resharder = Resharder(policy, rollout_layout(bridge, cfg), vllm_tp=cfg.rollout.tensor_parallel_size,
                          bucket_bytes=cfg.rollout.sync_bucket_mb << 20)
    return engine, resharder


