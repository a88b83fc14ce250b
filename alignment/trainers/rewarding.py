"""Rewarding a rollout batch with the job's ``reward.functions``: each function's raw scores
(functions of the text from :mod:`alignment.rewards.functions`: built-ins, graders and your own;
the reward model's score at the last token here), combined by :func:`alignment.algorithms.composite_reward.combine_rewards`, and
each function's global mean for the logs (``reward/<name>``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import torch

from alignment.algorithms.composite_reward import RewardTerm, combine_rewards
from alignment.algorithms.reward_shaping import overlong_penalty
from alignment.config import JobConfig
from alignment.data.tasks import Problem
from alignment.models.value_head import sequence_scores
from alignment.rewards.config import PROCESS_REWARD
from alignment.rewards.functions import function_scores
from alignment.rewards.policy import reward_terms
from alignment.data.samples import Sample
from alignment.rollout.base import RolloutEngine
from alignment.sandbox.runner import SandboxPool, sandbox_workers
from alignment.trainers.models import Models
from alignment.trainers.rl_phases import head_outputs, microbatches
from alignment.training.batching import make_batch
from alignment.training.config import shares_prompts
from alignment.training.megatron_step import all_reduce_sum

OVERLONG = "overlong"  # DAPO's overlong penalty (algorithm.overlong_buffer_len), an unwhitened term of weight 1


def _ps() -> Any:
    from megatron.core import parallel_state as ps

    return ps


def reward_model_scores(models: Models, batch: dict[str, torch.Tensor], cfg: JobConfig) -> torch.Tensor:
    """The frozen reward model's score ``[N]`` at each sequence's last token, on every rank of the
    model replica (computed on the last pipeline stage and summed over the pipeline group, where
    the other stages give 0). ``batch``: :func:`alignment.training.batching.make_batch`'s with
    ``prompt_lengths [N]``. Collective over the replica."""

    ps = _ps()
    models.placement.keep("reward_model",
                          *(("policy",) if cast(RolloutEngine, models.engine).shares_trainer_weights else ()))
    last = batch["response_mask"].sum(1).long() + batch["prompt_lengths"] - 1
    values = head_outputs(cast(torch.nn.Module, models.reward_model), microbatches(batch, cfg.trainer),
                          cfg.trainer.sequence_packing, shares_prompts(cfg))
    scores = sequence_scores(values, last).float() if values is not None else torch.zeros(len(last))
    if ps.get_pipeline_model_parallel_world_size() > 1:
        scores = torch.tensor(all_reduce_sum(scores.tolist(), ps.get_pipeline_model_parallel_group()))
    return scores


def padded_batch(models: Models, samples: Sequence[Sample]) -> dict[str, torch.Tensor]:
    """``samples`` as a padded batch with ``prompt_lengths [N]`` (what the reward model scores)."""
    batch = make_batch(list(samples), pad_id=models.tokenizer.pad_token_id or 0)
    batch["prompt_lengths"] = torch.tensor([len(s.prompt_ids) for s in samples])
    return batch


def score_terms(models: Models, problems: Sequence[Problem | None], samples: Sequence[Sample],
                terms: Sequence[RewardTerm], cfg: JobConfig, batch: dict[str, torch.Tensor] | None = None,
                pool: SandboxPool | None = None) -> dict[str, torch.Tensor]:
    """Raw scores ``[N]`` of every term for this rank's ``samples`` (``problems[i]``: the problem
    ``samples[i]`` answers, None without one); ``batch``: the samples' padded batch when already
    built; ``pool``: the sandbox pool that code-running terms take their runs from
    (:mod:`alignment.rewards.code_runs`). Model terms are collective over the model replica (its
    ranks hold the same samples)."""
    out: dict[str, torch.Tensor] = {}
    for t in terms:
        if t.name == "reward_model":
            out[t.name] = reward_model_scores(models, batch if batch is not None else padded_batch(models, samples),
                                              cfg)
        elif t.name == OVERLONG:
            a = cfg.algorithm
            lengths = torch.tensor([len(s.response_ids) for s in samples])
            out[t.name] = overlong_penalty(lengths, cfg.rollout.max_tokens, a.overlong_buffer_len,
                                           a.overlong_penalty_factor)
        else:
            timeout = cfg.reward.timeout_s
            out[t.name] = function_scores(t, problems, samples, cfg.rollout.max_tokens, timeout, sandbox_workers(),
                                          pool)
    drop_failed_groups(samples, cfg.rollout.group_size)
    return out


def drop_failed_groups(samples: Sequence[Sample], group_size: int) -> int:
    """A group (``group_size`` consecutive samples) with a sample a reward server failed to score
    (``info["reward_failed"]``, :mod:`alignment.rewards.remote`) leaves the update: every sample of it
    gets an all-zero ``loss_mask`` and ``info["reward_skipped"]``. Returns the groups dropped."""
    dropped = 0
    for g in range(0, len(samples), group_size):
        group = samples[g : g + group_size]
        if any("reward_failed" in s.info for s in group):
            dropped += 1
            for s in group:
                s.loss_mask = [0] * len(s.response_ids)
                s.info["reward_skipped"] = True
    return dropped


def job_terms(cfg: JobConfig) -> list[RewardTerm]:
    """The job's per-sample terms: ``reward.functions`` (:func:`alignment.config.reward_terms`) but the
    dense ``process_reward`` (:mod:`alignment.trainers.process_rewarding`), plus DAPO's overlong
    penalty when ``algorithm.overlong_buffer_len > 0``."""

    terms = [t for t in reward_terms(cfg) if t.name != PROCESS_REWARD]
    if cfg.algorithm.overlong_buffer_len > 0:
        terms.append(RewardTerm(OVERLONG))
    return terms


def combine(scores: dict[str, torch.Tensor], terms: Sequence[RewardTerm], n: int) -> torch.Tensor:
    """The rewards ``[n]`` of this rank's ``n`` samples (whitened terms over the global batch: the
    data-parallel group; collective); zeros when the only reward is the dense process reward."""
    if not terms:
        return torch.zeros(n)
    group = _ps().get_data_parallel_group()
    return combine_rewards(scores, terms, lambda sums: all_reduce_sum(sums, group))


def term_metrics(scores: dict[str, torch.Tensor], count: bool) -> dict[str, float]:
    """``reward/<name>``: each term's mean raw score over the global batch's samples it scored (NaN:
    the function did not apply, a judge's reply held no score); ``reward/<name>/scored``: the
    fraction of samples it scored. ``count``: whether this rank's samples count (one rank per
    data-parallel replica). Collective."""
    names = sorted(scores)
    if not names:
        return {}
    local: list[float] = []
    for k in names:
        known = ~torch.isnan(scores[k])
        local += [float(known.sum()), scores[k][known].sum().item(), float(known.numel())] if count else [0.0] * 3
    sums = all_reduce_sum(local)
    out = {}
    for i, k in enumerate(names):
        scored, total, n = sums[3 * i : 3 * i + 3]
        out[f"reward/{k}"], out[f"reward/{k}/scored"] = total / max(scored, 1.0), scored / max(n, 1.0)
    return out
