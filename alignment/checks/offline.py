"""The fixed-data algorithms' checks across sections (``sft``, ``rm``, ``dpo``, ``prm``: :mod:`alignment.checks`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from alignment.algorithms import registry
from alignment.algorithms.config import PreferenceConfig, ProcessRewardConfig, check_loss_type, has_section
from alignment.data.config import check_dataset
from alignment.data.step_data import SUPERVISIONS
from alignment.schema import ConfigError

if TYPE_CHECKING:
    from alignment.config import JobConfig
    from alignment.models.dims import ModelDims
    from parallel.layout import ParallelLayout


def validate(cfg: JobConfig, layout: ParallelLayout, dims: ModelDims) -> None:  # noqa: ARG001 - the checks' signature
    """SFT / reward model / DPO / PRM: the dataset matches the algorithm, batch sizes divide."""
    a, d, t = cfg.algorithm, cfg.data, cfg.trainer
    dp = layout.data_parallel_size
    if has_section(a, ProcessRewardConfig):
        steps(a)
    check_dataset(d, a.name, registry.get(a.name).examples)
    if has_section(a, PreferenceConfig):
        check_loss_type(a)
    if t.shared_prompt_packing:
        raise ConfigError(f"trainer.shared_prompt_packing=true: algorithm.name={a.name} does not use it (it applies "
                          "to the RL jobs: grpo family, ppo); set it to null or false")
    if t.offload:
        raise ConfigError(f"trainer.offload=true: algorithm.name={a.name} uses every model at every step, so "
                          "there is nothing idle to offload; it applies to the RL jobs (grpo family, ppo)")
    if t.global_batch_size % dp:
        raise ConfigError(f"trainer.global_batch_size={t.global_batch_size} must be a multiple of the data-parallel "
                          f"size {dp}; e.g. {[k * dp for k in range(1, 5)]}")
    per_rank = t.global_batch_size // dp
    if per_rank % t.micro_batch_size:
        valid = [m for m in range(1, per_rank + 1) if per_rank % m == 0]
        raise ConfigError(f"trainer.micro_batch_size={t.micro_batch_size} must divide the {per_rank} examples each "
                          f"data-parallel rank gets per step (global_batch_size / DP); valid values: {valid}")
    if d.heldout_size < dp:
        raise ConfigError(f"data.heldout_size={d.heldout_size} must be >= the data-parallel size {dp}")
    if has_section(a, PreferenceConfig) and a.loss_type == "kto" and (per_rank < 2 or d.heldout_size // dp < 2):
        raise ConfigError(f"algorithm.loss_type=kto estimates its reference point from mismatched pairs (a prompt "
                          f"with another pair's responses), so every data-parallel rank needs >= 2 pairs: "
                          f"trainer.global_batch_size={t.global_batch_size} and data.heldout_size={d.heldout_size} "
                          f"must each be >= {2 * dp} at data-parallel size {dp}")


def steps(a: ProcessRewardConfig) -> None:
    """The process reward model's algorithm settings: a step separator and a known supervision (its
    data: :func:`alignment.data.config.check_dataset`)."""

    if not a.step_separator:
        raise ConfigError("algorithm.step_separator is empty: give the string that ends a step, e.g. '\\n'")
    if a.supervision not in SUPERVISIONS:
        raise ConfigError(f"algorithm.supervision={a.supervision!r}: valid values are {', '.join(SUPERVISIONS)}")
