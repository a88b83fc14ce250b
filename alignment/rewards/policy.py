"""Which reward terms a job sums and how they are read: an RL job's terms (:func:`reward_terms`, the job's own
default when ``reward.functions`` is empty), the one that grades held-out answers (:func:`heldout_grader`), the
dense process reward's weight (:func:`process_reward_weight`), and whether PPO asks a task's questions
(:func:`ppo_on_task`). Read by the config checks, the trainers and the start-up summary; each takes the job's
config (``cfg``: a :class:`alignment.config.JobConfig` or a composed ``DictConfig``)."""

from __future__ import annotations

from alignment.algorithms import registry
from alignment.algorithms.composite_reward import RewardTerm
from alignment.envs.factory import HUB_ENVIRONMENTS
from alignment.rewards.config import PROCESS_REWARD, is_pairwise, terms_of


def reward_terms(cfg) -> list:
    """The :class:`alignment.algorithms.composite_reward.RewardTerm` s an RL job sums
    (``reward.functions``, or the job's own when empty: ``environment`` in an environment hub's environment, whose
    rubric scores the episodes, else ``correctness`` for the GRPO family and ``reward_model`` for PPO;
    :func:`alignment.rewards.config.terms_of`)."""
    if cfg.rollout.environment in HUB_ENVIRONMENTS:
        return terms_of(cfg.reward, "environment")
    return terms_of(cfg.reward, "reward_model" if registry.of(cfg).job == "ppo" else "correctness")


def heldout_grader(cfg):
    """The :class:`alignment.algorithms.composite_reward.RewardTerm` whose score grades held-out answers
    (right: >= 1): ``correctness`` (the task's grader) for ``data.task``; with ``data.train_files`` the first
    of ``reward.functions`` that reads the answer (not a model, ``length``, ``environment`` or a pairwise
    judge); in an environment hub's environment ``environment``, its rubric's score; None: none does (no held-out
    accuracy)."""

    if cfg.rollout.environment in HUB_ENVIRONMENTS:
        return RewardTerm("environment")
    if not cfg.data.train_files:
        return RewardTerm("correctness")
    skip = ("reward_model", "process_reward", "length", "environment")
    return next((t for t in reward_terms(cfg) if t.name not in skip and not is_pairwise(t)), None)


def process_reward_weight(cfg) -> float:
    """The weight of ``reward.functions``' dense ``process_reward`` term; 0.0 without one."""
    return next((t.weight for t in reward_terms(cfg) if t.name == PROCESS_REWARD), 0.0)


def ppo_on_task(cfg) -> bool:
    """Whether a PPO job asks ``data.task``'s questions or ``data.train_files``' prompts (graded by
    ``reward.functions``, in ``rollout.environment``'s episodes): with prompt files, or when
    ``reward.functions`` has no ``reward_model`` term. Otherwise PPO samples answers to
    dpo_en_demo's chat prompts for the reward model to judge."""
    return registry.of(cfg).job == "ppo" and (bool(cfg.data.train_files)
                                            or all(t.name != "reward_model" for t in reward_terms(cfg)))
