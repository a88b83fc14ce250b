"""Which job reads which setting: the settings a job's algorithm, trainer or rollout reads only in some jobs
or under some condition, each with the jobs that read it and when (:data:`RULES`; a key in no rule is read
by every job). :func:`unread_keys` lists what a composed job will not read; :mod:`alignment.compose` refuses
those the user set (on the command line or in their own YAML), naming who reads them, while the values the
shipped files set stay quiet; ``megalign train --print-config`` marks them.

The table was made by following every read from ``launchers/train.py`` (2026-12-01); a new setting that
only some jobs read adds its rule here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from alignment.algorithms import registry
from alignment.algorithms.config import section_keys
from alignment.config import OFFLINE_ALGORITHMS, RL_ALGORITHMS, algorithm_section
from alignment.envs.factory import HUB_ENVIRONMENTS
from alignment.models.hf_assets import is_hub_id
from alignment.rewards.policy import ppo_on_task, reward_terms
from alignment.rollout.config import played_by_agents

#: the jobs that grade held-out answers (alignment/trainers/heldout.py); ppo only on data.task / prompt files
HELDOUT = RL_ALGORITHMS


@dataclass(frozen=True)
class Rule:
    """``key`` (a field, or a section and everything below it) is read by the jobs ``jobs`` (``algorithm.name``
    values; None: every job whose config has the key), and only when ``when(cfg)`` holds; ``why``: the condition
    in words (for the error)."""

    key: str
    jobs: tuple[str, ...] | None
    when: Callable | None = None
    why: str = ""


def _files(cfg) -> bool:
    return bool(cfg.data.train_files)


def _prompts_of_task(cfg) -> bool:
    """An RL job's prompts come from data.task or data.train_files (not PPO's reward-model demo prompts)."""
    return registry.of(cfg).job != "ppo" or ppo_on_task(cfg)


def _vllm(cfg) -> bool:
    return cfg.rollout.backend == "vllm"


def _agent(cfg) -> bool:
    return played_by_agents(cfg.rollout)


def _hub(cfg) -> bool:
    return cfg.rollout.environment in HUB_ENVIRONMENTS


def _task_or_files(cfg) -> bool:
    """The prompts are data.task's or data.train_files' (not an environment hub's, nor PPO's demo prompts)."""
    return _prompts_of_task(cfg) and not _hub(cfg)


def _tracker(cfg) -> bool:
    return any(b != "tensorboard" for b in cfg.logger.backends)


_NO_AGENT = ("without an agent or an environment hub (their episodes: rollout.agent_max_tokens, "
             "agent_max_tokens_per_turn)")
_AGENT = "with rollout.agent, rollout.agent_command or an environment hub (rollout.environment=verifiers / openenv)"
_TASK = "on data.task or data.train_files"


def _has_term(name: str):
    return lambda cfg: any(t.name == name or t.runs == name for t in reward_terms(cfg))


RULES = (
    # ---- algorithm: each algorithm's section has its own keys only (alignment/algorithms/config.py), so
    # only the conditions on them are here (jobs=None: every algorithm whose section has the key)
    Rule("algorithm.whiten_level", None,
         lambda c: str(c.algorithm.advantage_estimator).startswith("reinforce_plus_plus"),
         "with algorithm.advantage_estimator=reinforce_plus_plus[_baseline]"),
    Rule("algorithm.rollout_correction.is_threshold", None,
         lambda c: c.algorithm.rollout_correction.is_level is not None, "with algorithm.rollout_correction.is_level"),
    Rule("algorithm.rollout_correction.mask_low", None,
         lambda c: c.algorithm.rollout_correction.mask_level is not None,
         "with algorithm.rollout_correction.mask_level"),
    Rule("algorithm.rollout_correction.mask_high", None,
         lambda c: c.algorithm.rollout_correction.mask_level is not None,
         "with algorithm.rollout_correction.mask_level"),
    Rule("algorithm.beta", None, lambda c: c.algorithm.loss_type != "orpo", "with a loss_type other than orpo"),
    Rule("algorithm.label_smoothing", None, lambda c: c.algorithm.loss_type == "sigmoid",
         "with algorithm.loss_type=sigmoid (cDPO)"),
    Rule("algorithm.simpo_gamma", None, lambda c: c.algorithm.loss_type == "simpo", "with algorithm.loss_type=simpo"),
    Rule("algorithm.orpo_lambda", None, lambda c: c.algorithm.loss_type == "orpo", "with algorithm.loss_type=orpo"),
    Rule("algorithm.max_sampling_rounds", None, lambda c: c.algorithm.dynamic_sampling,
         "with algorithm.dynamic_sampling=true"),
    Rule("algorithm.overlong_penalty_factor", None, lambda c: c.algorithm.overlong_buffer_len > 0,
         "with algorithm.overlong_buffer_len > 0"),
    Rule("algorithm.iteration_steps", None, lambda c: c.algorithm.ref_update == "iteration",
         "with algorithm.ref_update=iteration"),
    Rule("algorithm.step_separator", None,
         lambda c: not registry.get(c.algorithm.name).online or _has_term("process_reward")(c),
         "with a process_reward term"),
    Rule("algorithm.distill_beta", None, lambda c: c.algorithm.distill_loss == "jsd", "with algorithm.distill_loss=jsd"),
    # ---- rollout: the RL jobs' sampling
    Rule("rollout", RL_ALGORITHMS),
    Rule("rollout.eval_max_tokens", HELDOUT, _prompts_of_task, "on data.task or data.train_files"),
    Rule("rollout.eval_pass_k", HELDOUT, _prompts_of_task, "on data.task or data.train_files"),
    Rule("rollout.kv_cache_gib", RL_ALGORITHMS, _vllm, "with rollout.backend=vllm"),
    Rule("rollout.gpu_memory_utilization", RL_ALGORITHMS, _vllm, "with rollout.backend=vllm"),
    Rule("rollout.sync_bucket_mb", RL_ALGORITHMS, _vllm, "with rollout.backend=vllm"),
    Rule("rollout.partial_chunk_tokens", RL_ALGORITHMS, lambda c: c.rollout.partial, "with rollout.partial=true"),
    Rule("rollout.partial_carry_over", ("grpo",)),
    Rule("rollout.tools", RL_ALGORITHMS, lambda c: c.rollout.environment == "tools", "with rollout.environment=tools"),
    Rule("rollout.max_turns", RL_ALGORITHMS, lambda c: c.rollout.environment != "single_turn" and not _hub(c),
         "in a multi-turn rollout.environment (an environment hub's has its own)"),
    Rule("rollout.environment_id", ("grpo", "ppo"), _hub, "with rollout.environment=verifiers or openenv"),
    Rule("rollout.environment_args", ("grpo", "ppo"), _hub, "with rollout.environment=verifiers or openenv"),
    Rule("rollout.max_tokens", RL_ALGORITHMS, lambda c: not _agent(c), _NO_AGENT),
    Rule("rollout.eval_max_tokens", RL_ALGORITHMS, lambda c: not _agent(c), _NO_AGENT),
    Rule("rollout.max_tokens_per_turn", RL_ALGORITHMS, lambda c: not _agent(c), _NO_AGENT),
    Rule("rollout.agent_max_tokens", ("grpo", "ppo"), _agent, _AGENT),
    Rule("rollout.agent_max_tokens_per_turn", ("grpo", "ppo"), _agent, _AGENT),
    Rule("rollout.agent_concurrency", ("grpo", "ppo"), _agent, _AGENT),
    Rule("rollout.agent_timeout_s", ("grpo", "ppo"), _agent, _AGENT),
    # ---- trainer
    Rule("trainer.global_batch_size", OFFLINE_ALGORITHMS),
    Rule("trainer.critic_lr", ("ppo",)),
    Rule("trainer.rollout_table_every", RL_ALGORITHMS),
    Rule("trainer.offload", RL_ALGORITHMS),
    Rule("trainer.shared_prompt_packing", ("grpo", "distill", "ppo", "rft", "online_dpo")),
    Rule("trainer.balance_batch", ("grpo", "distill", "ppo", *OFFLINE_ALGORITHMS)),
    Rule("trainer.eval_cache", HELDOUT, _prompts_of_task, "on data.task or data.train_files"),
    Rule("trainer.eval_before_overlap", HELDOUT, _prompts_of_task, "on data.task or data.train_files"),
    Rule("trainer.save_heldout_answers", HELDOUT, _prompts_of_task, "on data.task or data.train_files"),
    # ---- data: a built-in task, prompt files (RL) or a dataset of examples (SFT / RM / DPO / PRM)
    Rule("data.task", HELDOUT, lambda c: _task_or_files(c) and not _files(c),
         "without data.train_files or an environment hub"),
    Rule("data.generator", HELDOUT, lambda c: _task_or_files(c) and not _files(c),
         "without data.train_files or an environment hub"),
    Rule("data.generator_kwargs", HELDOUT, lambda c: _task_or_files(c) and not _files(c),
         "without data.train_files or an environment hub"),
    Rule("data.train_size", (*HELDOUT, *OFFLINE_ALGORITHMS), lambda c: not _files(c) and not _hub(c),
         "without data.train_files or an environment hub"),
    Rule("data.heldout_size", (*HELDOUT, *OFFLINE_ALGORITHMS), lambda c: not _files(c) and not _hub(c),
         "without data.train_files or an environment hub"),
    Rule("data.train_files", RL_ALGORITHMS, lambda c: not _hub(c),
         "without an environment hub (rollout.environment=verifiers / openenv: its tasks are the prompts)"),
    Rule("data.heldout_files", None, lambda c: not _hub(c),
         "without an environment hub (rollout.environment=verifiers / openenv: it holds its own tasks out)"),
    Rule("data.heldout_fraction", None, lambda c: not _hub(c),
         "without an environment hub (rollout.environment=verifiers / openenv: it holds its own tasks out)"),
    Rule("data.prompt_key", HELDOUT, _files, "with data.train_files"),
    Rule("data.answer_key", HELDOUT, _files, "with data.train_files"),
    Rule("data.response_key", ("distill",), _files, "with data.train_files"),
    Rule("data.overlong_prompts", HELDOUT, _prompts_of_task, "on data.task or data.train_files"),
    Rule("data.shuffle", HELDOUT, _prompts_of_task, "on data.task or data.train_files"),
    Rule("data.instruction", HELDOUT, _task_or_files,
         "on data.task or data.train_files (an environment's prompts are its own)"),
    Rule("data.system_prompt", HELDOUT, _task_or_files,
         "on data.task or data.train_files (an environment's prompts are its own)"),
    Rule("data.chat_template_kwargs", HELDOUT, _prompts_of_task, "on data.task or data.train_files"),
    Rule("data.dataset", OFFLINE_ALGORITHMS),
    Rule("data.columns", ("sft", "rm", "dpo")),
    Rule("data.max_length", OFFLINE_ALGORITHMS),
    Rule("data.max_prompt_length", ("sft", "rm", "dpo", "ppo"), lambda c: registry.of(c).job != "ppo" or not ppo_on_task(c),
         "(ppo: on its reward model's demo prompts)"),
    # ---- model
    Rule("model.critic_path", ("ppo",)),
    Rule("model.reward_model_path", RL_ALGORITHMS,
         lambda c: registry.of(c).job == "ppo" or _has_term("reward_model")(c), "with a reward_model reward term"),
    Rule("model.teacher_path", ("distill",)),
    Rule("model.revision", (*RL_ALGORITHMS, *OFFLINE_ALGORITHMS), lambda c: is_hub_id(str(c.model.path)),
         "with model.path a Hub id (org/name)"),
    Rule("model.lora.alpha", (*RL_ALGORITHMS, *OFFLINE_ALGORITHMS), lambda c: c.model.lora.rank > 0,
         "with model.lora.rank > 0"),
    Rule("model.lora.dropout", (*RL_ALGORITHMS, *OFFLINE_ALGORITHMS), lambda c: c.model.lora.rank > 0,
         "with model.lora.rank > 0"),
    Rule("model.lora.target_modules", (*RL_ALGORITHMS, *OFFLINE_ALGORITHMS), lambda c: c.model.lora.rank > 0,
         "with model.lora.rank > 0"),
    Rule("model.lora.vision_tower", (*RL_ALGORITHMS, *OFFLINE_ALGORITHMS), lambda c: c.model.lora.rank > 0,
         "with model.lora.rank > 0"),
    # ---- reward: what the RL jobs score samples with
    Rule("reward", RL_ALGORITHMS),
    Rule("reward.process_reward_model", ("grpo", "ppo"), _has_term("process_reward"), "with a process_reward term"),
    # ---- profile, parallel
    Rule("profile.steps", (*RL_ALGORITHMS, *OFFLINE_ALGORITHMS), lambda c: c.profile.enabled, "with profile.enabled=true"),
    Rule("profile.ranks", (*RL_ALGORITHMS, *OFFLINE_ALGORITHMS), lambda c: c.profile.enabled,
         "with profile.enabled=true"),
    Rule("parallel.cp_comm_type", (*RL_ALGORITHMS, *OFFLINE_ALGORITHMS),
         lambda c: c.parallel.context_parallel_size > 1, "with parallel.context_parallel_size > 1"),
    # ---- logger: the trackers' settings, read when one is on
    Rule("logger.project", (*RL_ALGORITHMS, *OFFLINE_ALGORITHMS), _tracker, "with wandb, mlflow or trackio in logger.backends"),
    Rule("logger.on_error", (*RL_ALGORITHMS, *OFFLINE_ALGORITHMS), _tracker,
         "with wandb, mlflow or trackio in logger.backends"),
)


def _rules(key: str) -> list[Rule]:
    """The rules of ``key`` and of the sections above it, outermost first."""
    return [r for r in RULES if key == r.key or key.startswith(r.key + ".")]


def unread_reason(cfg, key: str) -> str | None:
    """Why the composed job ``cfg`` does not read ``key`` (a dotted field), or None when it does."""
    name = cfg.algorithm.name
    like = registry.get(name).like or name  # an algorithm of your own reads as the built-in it is like
    section, _, field = key.partition(".")
    if section == "algorithm" and field and field.split(".")[0] not in section_keys(algorithm_section(cfg)):
        return f"algorithm.name={name} has no such setting"
    for rule in _rules(key):
        if rule.jobs is not None and like not in rule.jobs:
            return f"algorithm.name={name} does not read it (it is read by {', '.join(rule.jobs)})"
        if rule.when is not None and not rule.when(cfg):
            return f"algorithm.name={name} reads it only {rule.why}"
    return None


def unread_keys(cfg, keys) -> dict[str, str]:
    """Of the dotted ``keys``, those the composed job ``cfg`` does not read, each with why
    (:func:`unread_reason`)."""
    out = {}
    for key in keys:
        reason = unread_reason(cfg, key)
        if reason is not None:
            out[key] = reason
    return out
