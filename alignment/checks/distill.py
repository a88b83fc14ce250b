"""``algorithm.name=distill``'s checks across sections (:mod:`alignment.checks`): GRPO's step's, and a teacher,
a loss and samples it can train on."""

from __future__ import annotations

from typing import TYPE_CHECKING

from alignment.algorithms.config import check_distill, check_estimators
from alignment.checks import grpo
from alignment.data.config import check_prompt_source
from alignment.rewards.policy import process_reward_weight
from alignment.schema import ConfigError

if TYPE_CHECKING:
    from alignment.config import JobConfig
    from alignment.models.dims import ModelDims
    from parallel.layout import ParallelLayout


def validate(cfg: JobConfig, layout: ParallelLayout, dims: ModelDims) -> None:
    """On-policy distillation: GRPO's step's checks (:mod:`alignment.checks.grpo`), its teacher and loss, and
    groups of >= 2 samples when the task's advantages are weighted in."""
    a, r = cfg.algorithm, cfg.rollout
    check_prompt_source(cfg.data)
    check_estimators(a)
    teacher(cfg)
    grpo.routing_replay(a, dims)
    grpo.rollout_routing(cfg)
    if a.routing_replay == "r3" and a.distill_samples != "student":
        raise ConfigError(f"algorithm.routing_replay=r3 replays the student's own sampling routing, but with "
                          f"algorithm.distill_samples={cfg.algorithm.distill_samples} the student does not sample; "
                          "set algorithm.routing_replay=none")
    if r.temperature <= 0:
        raise ConfigError(f"rollout.temperature={r.temperature}: on-policy distillation samples, it needs a "
                          "temperature > 0")
    if r.group_size < 2 and a.task_reward_weight:
        raise ConfigError(f"rollout.group_size={r.group_size}: the task's group-normalised advantages "
                          f"(algorithm.task_reward_weight={a.task_reward_weight}) need at least 2 samples per prompt; "
                          "set rollout.group_size >= 2, or algorithm.task_reward_weight=0 (distillation alone)")
    grpo.batches(cfg, layout)


def teacher(cfg: JobConfig) -> None:
    """On-policy distillation: a loss that exists and a teacher to score with (its files and tokenizer:
    :func:`launchers.input_checks.check_model_files`)."""
    check_distill(cfg.algorithm)
    if not cfg.model.teacher_path:
        raise ConfigError("algorithm.name=distill needs a teacher: set model.teacher_path to its HF directory (e.g. "
                          "outputs/grpo_smollm2_arithmetic/hf, a trained policy's export) or a .gguf file")
    if process_reward_weight(cfg):
        raise ConfigError("reward.functions has process_reward, but algorithm.name=distill trains on the teacher's "
                          "per-token signal already; drop process_reward (or use algorithm.name=grpo)")
    if cfg.algorithm.distill_samples == "teacher":
        split = {name: v for name in ("pipeline_model_parallel_size", "context_parallel_size")
                 if (v := getattr(cfg.parallel, name)) > 1}
        if cfg.parallel.sequence_parallel:
            split["sequence_parallel"] = True
        if split or cfg.rollout.placement != "colocated":
            given = ", ".join([f"parallel.{k}={v}" for k, v in split.items()]
                              + ([f"rollout.placement={cfg.rollout.placement}"] if cfg.rollout.placement != "colocated"
                                 else []))
            raise ConfigError(f"algorithm.distill_samples=teacher generates with Megatron's engine on the teacher's "
                              f"shards on the trainer ranks (whole, tensor- or expert-parallel replicas), but {given}: "
                              "set those to 1 / false / colocated")
    if cfg.algorithm.distill_samples == "dataset":
        dataset_samples(cfg)


def dataset_samples(cfg: JobConfig) -> None:
    """``algorithm.distill_samples=dataset``: one answer per prompt from a column of the prompt files,
    read on the trainer ranks (no engine samples it), one turn."""
    r, d = cfg.rollout, cfg.data
    if not d.train_files or not d.response_key:
        raise ConfigError("algorithm.distill_samples=dataset trains on each prompt's answer in a file: set "
                          "data.train_files and data.response_key (the column holding the answers, e.g. completion)")
    wrong = {name: v for name, v, ok in (("rollout.group_size", r.group_size, 1), ("rollout.max_turns", r.max_turns, 1),
                                         ("rollout.max_staleness", r.max_staleness, 0),
                                         ("rollout.placement", r.placement, "colocated")) if v != ok}
    if wrong:
        given = ", ".join(f"{k}={v}" for k, v in wrong.items())
        raise ConfigError(f"algorithm.distill_samples=dataset takes each prompt's one answer from the file, on the "
                          f"trainer ranks, but {given}: set rollout.group_size=1, max_turns=1, max_staleness=0, "
                          "placement=colocated")
