"""The dense ``process_reward`` term of an RL job: a frozen process reward model
(``reward.process_reward_model``, trained by ``--config-name prm``) scores every step of every
sampled response, P(step correct) = sigmoid(head) at the step's last token, and the scores become
per-token advantages (GRPO family, :func:`alignment.algorithms.process_rewards.process_advantages`)
or rewards on the step-end tokens (PPO, :func:`alignment.algorithms.process_rewards.place_step_rewards`).

The PRM reads the sample's own prompt followed by its steps, tokenised as it was trained
(:func:`alignment.data.step_data.encode_steps`); a step's reward is placed on the response token
that completes the step's text (:func:`alignment.data.step_data.response_steps`; two steps completed by
the same token: the later one's score). Every sample is one row of the PRM's batch, one without a step
(or whose first step does not fit in ``rollout.max_model_len``) its prompt and EOS, read nowhere: the
same rows on every rank for the same samples, as pipeline stages and expert all-to-alls need. A
response cut at ``rollout.max_tokens`` has its last step closed as if it were finished."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

import torch

from alignment.config import JobConfig
from alignment.data.step_data import encode_steps, response_steps
from alignment.rewards.policy import process_reward_weight
from alignment.data.samples import Sample
from alignment.rollout.base import RolloutEngine
from alignment.trainers.models import Models
from alignment.trainers.rl_phases import head_outputs, microbatches
from alignment.training.batching import make_sequence_batch
from alignment.training.megatron_step import all_reduce_sum


@dataclass
class StepRewards:
    """Per sample: the PRM's P(step correct) of each step (``rewards``), the response-token index
    that ends it (``positions``), and the term's weight."""

    rewards: list[list[float]]
    positions: list[list[int]]
    weight: float


def score_steps(models: Models, samples: Sequence[Sample], cfg: JobConfig) -> StepRewards:
    """The PRM's step scores for this rank's ``samples``: computed on the last pipeline stage and
    summed over the pipeline group, so every rank of the replica holds them. Collective over the
    model replica (whose ranks hold the same samples)."""
    from megatron.core import parallel_state as ps

    sep, tok = cfg.algorithm.step_separator, models.tokenizer
    rows, ends, positions = [], [], []
    for s in samples:
        steps, where = response_steps(tok, s.response_ids, sep)
        try:
            ids, prompt_len, at = encode_steps(tok, s.prompt_ids, steps, sep, cfg.rollout.max_model_len)
        except ValueError:  # no step, or the first does not fit: a row read nowhere
            ids, prompt_len, at = list(s.prompt_ids) + [tok.eos_token_id], len(s.prompt_ids), []
        rows.append((ids, prompt_len))
        ends.append(at)
        positions.append(where[: len(at)])
    flat = []
    if rows:
        models.placement.keep("process_reward_model",
                              *(("policy",) if cast(RolloutEngine, models.engine).shares_trainer_weights else ()))
        pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        batch = make_sequence_batch(rows, pad)
        values = head_outputs(cast(torch.nn.Module, models.process_reward_model), microbatches(batch, cfg.trainer),
                              cfg.trainer.sequence_packing)
        flat = ([float(torch.sigmoid(values[j, e].float())) for j, at in enumerate(ends) for e in at]
                if values is not None else [0.0] * sum(len(at) for at in ends))
        if ps.get_pipeline_model_parallel_world_size() > 1:
            flat = all_reduce_sum(flat, ps.get_pipeline_model_parallel_group())
    rewards, placed, k = [], [], 0
    for where in positions:
        scores = flat[k : k + len(where)]
        k += len(where)
        keep = [j for j in range(len(where)) if j + 1 == len(where) or where[j + 1] != where[j]]
        rewards.append([scores[j] for j in keep])
        placed.append([where[j] for j in keep])
    return StepRewards(rewards, placed, process_reward_weight(cfg))


def step_metrics(steps: StepRewards | None, count: bool) -> dict[str, float]:
    """``reward/process_reward``: the mean P(step correct) over every step of the global batch, and
    ``process_reward/steps``: steps per response; ``count``: whether this rank's samples count (one
    rank per data-parallel replica). Collective when ``steps`` is given."""
    if steps is None:
        return {}
    n, total, samples = all_reduce_sum([float(sum(map(len, steps.rewards))) if count else 0.0,
                                        float(sum(map(sum, steps.rewards))) if count else 0.0,
                                        float(len(steps.rewards)) if count else 0.0])
    return {"reward/process_reward": total / max(n, 1.0), "process_reward/steps": n / max(samples, 1.0)}
