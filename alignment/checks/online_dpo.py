"""``algorithm.name=online_dpo``'s checks across sections (:mod:`alignment.checks`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from alignment.algorithms.config import check_loss_type
from alignment.algorithms.preference_loss import REFERENCE_FREE
from alignment.checks import VARIABLE_ROWS_EP
from alignment.data.config import check_prompt_source
from alignment.schema import ConfigError

if TYPE_CHECKING:
    from alignment.config import JobConfig
    from alignment.models.dims import ModelDims
    from parallel.layout import ParallelLayout

#: ``algorithm.ref_update`` values
REF_UPDATES = ("initial", "iteration")


def validate(cfg: JobConfig, layout: ParallelLayout, dims: ModelDims) -> None:  # noqa: ARG001 - the checks' signature
    """Online / iterative DPO: a DPO-family loss, >= 2 samples per prompt, a reference to update
    (not LoRA's frozen base), variable pair counts."""

    a, r = cfg.algorithm, cfg.rollout
    dp = layout.data_parallel_size
    check_prompt_source(cfg.data)
    check_loss_type(a)
    if r.group_size < 2 or r.temperature <= 0:
        raise ConfigError(f"rollout.group_size={r.group_size} / temperature={r.temperature}: online DPO pairs the best "
                          "and worst of group_size >= 2 samples per prompt, drawn at a temperature > 0")
    if r.prompts_per_step % dp:
        raise ConfigError(f"rollout.prompts_per_step={r.prompts_per_step} must be a multiple of the data-parallel "
                          f"size {dp}; e.g. {[k * dp for k in range(1, 5)]}")
    if a.ref_update not in REF_UPDATES:
        raise ConfigError(f"algorithm.ref_update={a.ref_update!r}: valid values are {', '.join(REF_UPDATES)}")
    if a.ref_update == "iteration":
        if a.loss_type in REFERENCE_FREE:
            raise ConfigError(f"algorithm.ref_update=iteration: algorithm.loss_type={a.loss_type} uses no reference; "
                              "set algorithm.ref_update=initial or a loss with a reference (sigmoid, ipo, hinge, kto)")
        if cfg.model.lora.rank:
            raise ConfigError("algorithm.ref_update=iteration with model.lora: a LoRA job's reference is the frozen "
                              "base, which cannot become the policy; set algorithm.ref_update=initial")
    if layout.expert_model_parallel_size > 1:
        raise ConfigError(VARIABLE_ROWS_EP.format(name="online_dpo", what="pairs"))
    if layout.pipeline_model_parallel_size > 1 and not cfg.trainer.sequence_packing:
        raise ConfigError("algorithm.name=online_dpo trains on however many pairs had no tie, so its last "
                          "micro-batch may have fewer rows; with parallel.pipeline_model_parallel_size > 1 set "
                          "trainer.sequence_packing=true (one packed row per micro-batch)")
