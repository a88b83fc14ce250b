"""What one rank holds for a job (:class:`Models`), whatever the algorithm: the trained policy shard
and its optimizer, the frozen models the job scores or regularises with, the rollout engine (online
jobs), the bridge and the tokenizer. ``launchers/build.py``'s ``build_models`` fills it for every job."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from alignment.models.bridge import Bridge
from alignment.rollout.base import RolloutEngine
from alignment.rollout.episodes.multi_turn import EpisodeSetup
from alignment.training.offload import DevicePlacement
from parallel.reshard import Resharder

if TYPE_CHECKING:  # agent_rollout imports this module
    from alignment.trainers.agent_rollout import AgentRollout


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
    optimizer: Any  # Megatron's optimizer
    reference: torch.nn.Module | None
    engine: RolloutEngine | None
    bridge: Bridge
    tokenizer: Any  # the HF tokenizer
    vocab_size: int
    placement: DevicePlacement = field(default_factory=lambda: DevicePlacement(enabled=False))
    resharder: Resharder | None = None  # feeds a vLLM engine; None: the engine runs the policy
    reward_model: torch.nn.Module | None = None  # frozen scalar-head model (reward.functions: reward_model)
    process_reward_model: torch.nn.Module | None = None  # frozen PRM (reward.functions: process_reward)
    critic: torch.nn.Module | None = None  # PPO's value model (DDP), trained with critic_optimizer
    critic_optimizer: Any = None  # Megatron's optimizer
    episodes: EpisodeSetup | None = None  # the episodes' environment and turns (rollout.environment)
    teacher: torch.nn.Module | None = None  # on-policy distillation's frozen teacher (model.teacher_path)
    #: algorithm.distill_samples=teacher: Megatron's engine on the teacher's own shards (it samples the answers)
    teacher_engine: RolloutEngine | None = None
    #: rollout.agent / agent_command: the agent machinery (set up on first use)
    agents: AgentRollout | None = None
