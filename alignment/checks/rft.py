"""``algorithm.name=rft``'s checks across sections (:mod:`alignment.checks`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import math

from alignment.checks import VARIABLE_ROWS_EP
from alignment.data.config import check_prompt_source
from alignment.rewards.policy import reward_terms
from alignment.schema import ConfigError

if TYPE_CHECKING:
    from alignment.config import JobConfig
    from alignment.models.dims import ModelDims
    from parallel.layout import ParallelLayout


def validate(cfg: JobConfig, layout: ParallelLayout, dims: ModelDims) -> None:  # noqa: ARG001 - the checks' signature
    """Rejection-sampling fine-tuning: a task to grade, samples to filter, no reference, a reward
    that is a per-sample score (no whitening) and micro-batches of any size."""

    a, r = cfg.algorithm, cfg.rollout
    dp = layout.data_parallel_size
    check_prompt_source(cfg.data)
    if not math.isfinite(a.accept_threshold):
        raise ConfigError(f"algorithm.accept_threshold={a.accept_threshold}: give a finite reward (1.0: correct "
                          "answers under the 0/1 grader)")
    terms = reward_terms(cfg)
    bounded = ("correctness", "format", "length", "environment", "math_verify", "exact_match", "numeric", "regex",
               "code_tests")
    if all(t.runs in bounded for t in terms):  # bounded terms: the best reward a sample can get
        # correctness / format in [0, 1]; length in [-1, -1 / max_tokens] (a response has a token; a negative
        # weight rewards length); the overlong penalty <= 0
        best = sum(0.0 if t.name == "environment" else max(t.weight, 0.0) if t.runs not in ("length",) else
                   (-t.weight if t.weight < 0 else -t.weight / r.max_tokens) for t in terms)
        if a.accept_threshold > best:
            raise ConfigError(f"algorithm.accept_threshold={a.accept_threshold} is above the best reward "
                              f"reward.functions can give ({best:g}: correctness, format and the graders score in [0, 1], length in "
                              "[-1, -1 / rollout.max_tokens], the overlong penalty at most 0), so no sample would ever "
                              "be kept; lower it")
    if layout.expert_model_parallel_size > 1:
        raise ConfigError(VARIABLE_ROWS_EP.format(name="rft", what="accepted samples"))
    whitened = [f.name for f in cfg.reward.functions if f.whiten]
    if whitened:
        raise ConfigError(f"reward.functions {whitened} whiten: algorithm.name=rft accepts each sample by its own "
                          "reward against algorithm.accept_threshold, which batch statistics would move; set "
                          "whiten: false")
    if r.temperature <= 0:
        raise ConfigError(f"rollout.temperature={r.temperature}: rejection sampling draws group_size samples per "
                          "problem at a temperature > 0")
    if r.prompts_per_step % dp:
        raise ConfigError(f"rollout.prompts_per_step={r.prompts_per_step} must be a multiple of the data-parallel "
                          f"size {dp}; e.g. {[k * dp for k in range(1, 5)]}")
    if layout.pipeline_model_parallel_size > 1 and not cfg.trainer.sequence_packing:
        raise ConfigError("algorithm.name=rft trains on however many samples were accepted, so its last micro-batch "
                          "may have fewer rows; with parallel.pipeline_model_parallel_size > 1 set "
                          "trainer.sequence_packing=true (one packed row per micro-batch)")
