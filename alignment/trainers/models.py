"""What one rank holds for a job (:class:`Models`), whatever the algorithm: the trained policy shard
and its optimizer, the frozen models the job scores or regularises with, the rollout engine (online
jobs), the bridge and the tokenizer. ``launchers/build.py``'s ``build_models`` fills it for every job."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from alignment.rollout.base import RolloutEngine
from alignment.training.offload import DevicePlacement


@dataclass
class Models:
    """This rank's models.

    ``policy``: the trained shard (DDP-wrapped; a scalar-head value model for a reward-model or PRM
    job), with its ``optimizer``. ``reference``: the frozen reference (KL term, DPO family), or None.
    ``engine``: the rollout engine (None in an offline job). ``bridge`` / ``tokenizer``: the HF
    names and tokenizer of ``policy``; ``vocab_size``: the HF vocabulary (logits beyond it are
    padding). ``placement`` moves idle models to host memory between phases (``trainer.offload``).
    """

    policy: torch.nn.Module
    optimizer: object
    reference: torch.nn.Module | None
    engine: RolloutEngine | None
    bridge: object
    tokenizer: object
    vocab_size: int
    placement: DevicePlacement = field(default_factory=lambda: DevicePlacement(enabled=False))
    resharder: object = None  # parallel.reshard.Resharder feeding a vLLM engine; None: the engine runs the policy
    reward_model: torch.nn.Module | None = None  # frozen scalar-head model (reward.functions: reward_model)
    process_reward_model: torch.nn.Module | None = None  # frozen PRM (reward.functions: process_reward)
    critic: torch.nn.Module | None = None  # PPO's value model (DDP), trained with critic_optimizer
    critic_optimizer: object = None
    episodes: object = None  # alignment.rollout.episodes.multi_turn.EpisodeSetup (rollout.environment)
    teacher: torch.nn.Module | None = None  # on-policy distillation's frozen teacher (model.teacher_path)
    #: algorithm.distill_samples=teacher: Megatron's engine on the teacher's own shards (it samples the answers)
    teacher_engine: RolloutEngine | None = None
    #: rollout.agent / agent_command: alignment.trainers.agent_rollout.AgentRollout (set up on first use)
    agents: object = None
