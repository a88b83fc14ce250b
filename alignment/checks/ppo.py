"""``algorithm.name=ppo``'s checks across sections (:mod:`alignment.checks`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from alignment.data.config import check_prompt_source
from alignment.rewards.policy import ppo_on_task
from alignment.schema import ConfigError

if TYPE_CHECKING:
    from alignment.config import JobConfig
    from alignment.models.dims import ModelDims
    from parallel.layout import ParallelLayout


def validate(cfg: JobConfig, layout: ParallelLayout, dims: ModelDims) -> None:  # noqa: ARG001 - the checks' signature
    """PPO: a reward model (or a task and a critic), and mini-batches that divide the rollout batch."""
    dp = layout.data_parallel_size
    a, r, t = cfg.algorithm, cfg.rollout, cfg.trainer
    if ppo_on_task(cfg):
        check_prompt_source(cfg.data)
        if not (cfg.model.critic_path or cfg.model.reward_model_path):
            raise ConfigError("model.critic_path and model.reward_model_path are empty: PPO's critic starts from one "
                              "of them (a value head on that checkpoint), e.g. model.critic_path=${model.path}")
    elif not cfg.model.reward_model_path:
        raise ConfigError("model.reward_model_path is empty: PPO needs a trained reward model "
                          "(e.g. outputs/rm_smollm2_dpo_en_demo/hf from --config-name rm), or reward.functions on "
                          "data.task's answers (e.g. [{name: correctness}]) and a model.critic_path")
    if r.prompts_per_step % dp:
        raise ConfigError(f"rollout.prompts_per_step={r.prompts_per_step} must be a multiple of the data-parallel "
                          f"size {dp}; e.g. {[k * dp for k in range(1, 5)]}")
    rows = r.prompts_per_step // dp * r.group_size
    if rows % a.num_mini_batches or (rows // a.num_mini_batches) % t.micro_batch_size:
        raise ConfigError(f"algorithm.num_mini_batches={a.num_mini_batches} x trainer.micro_batch_size="
                          f"{t.micro_batch_size} must divide the {rows} sequences of each data-parallel rank "
                          f"(prompts_per_step / DP x group_size)")
    if r.temperature <= 0:
        raise ConfigError(f"rollout.temperature={r.temperature}: PPO samples, it needs a temperature > 0")
