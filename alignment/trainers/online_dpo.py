"""Online and iterative DPO: the policy makes its own preference pairs (Guo et al. 2024, "Direct
Language Model Alignment from Online AI Feedback"; Xu et al. 2023, "Some things are more CRINGE
than others: Iterative Preference Optimization with the Pairwise Cringe Loss"; Yuan et al. 2024,
"Self-Rewarding Language Models"). The loop around it is :mod:`launchers.loop`.

:func:`collect` (the rollout collector):
  1. sample — ``rollout.group_size`` >= 2 responses per prompt (the rollout engine, as GRPO)
  2. judge  — ``reward.functions`` (default: the task's grader; ``reward_model``: a trained RM)
  3. pair   — per prompt the best as chosen and the worst as rejected; prompts whose samples all
              score the same give no pair (:func:`alignment.algorithms.preference_pairs.best_worst_pairs`)
:func:`train` (the trainer step):
  4. deal   — the pairs of every data-parallel rank are dealt out evenly again (ties leave ranks
              with different counts); fewer pairs than ranks: no update this step
  5. reference — ``algorithm.ref_update=initial``: the initial policy; ``iteration``: at every
              ``algorithm.iteration_steps``-th step the reference becomes the current policy
              (iterative DPO), and checkpoints hold it, so a run resumed mid-iteration keeps it
  6. DPO    — any ``algorithm.loss_type`` of :class:`alignment.trainers.dpo.DPOObjective` on the
              pairs, one Adam step (:func:`alignment.trainers.offline.train_step`)
The loop then syncs the new weights into the engine, so the next pairs come from the new policy.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, cast

import torch
import torch.distributed as dist

from alignment.algorithms.preference_pairs import best_worst_pairs
from alignment.config import JobConfig
from alignment.data.images import ImageInputs
from alignment.data.tasks import Problem
from alignment.rewards.code_runs import early_grading
from alignment.rollout.base import RolloutEngine
from alignment.trainers.dpo import DPOObjective
from alignment.trainers.models import Models
from alignment.trainers.offline import build_batch, train_step
from alignment.trainers.rewarding import combine, job_terms, score_terms, term_metrics
from alignment.trainers.rl_phases import Rollout, generate_for_group, image_processor, request, rollout_phase
from alignment.training.batching import MicroBatching
from alignment.training.megatron_step import all_reduce_sum
from alignment.training.offload import trainable
from parallel.names import unwrap
from parallel.state import replica_group


def collect(models: Models, problems: list[Problem], cfg: JobConfig, version: int = 0,
            refill: Callable[[int], list[Problem]] | None = None) -> Rollout:  # noqa: ARG001
    """This DP rank's pairs for ``problems``: ``Rollout.samples`` interleaved ``[chosen_0,
    rejected_0, ...]`` (none when every prompt tied), ``Rollout.rewards`` the judge's reward of
    every sampled response ``[P * group_size]`` and ``reward_terms`` each term's raw scores;
    ``info``: ``prompts``, ``pairs``, ``chosen_reward_sum``, ``rejected_reward_sum``. Collective
    over the model replica (and the data-parallel group for whitened terms). ``refill``: the loop's supply of
    more problems, unused (no dynamic sampling here)."""
    t0 = time.perf_counter()
    g = cfg.rollout.group_size
    terms = job_terms(cfg)
    with early_grading([t.runs for t in terms], problems) as (pool, on_done):  # code runs start as answers come
        with rollout_phase(models):
            groups = generate_for_group(cast(RolloutEngine, models.engine), *request(models.tokenizer, problems, cfg,
                                                                image_processor(models)), on_done)
        samples = [s for grp in groups for s in grp]
        scores = score_terms(models, [p for p in problems for _ in range(g)], samples, terms, cfg, pool=pool)
    rewards = combine(scores, terms, len(samples))
    pairs = [p for p in best_worst_pairs(rewards, g) if p is not None]
    info = {"prompts": float(len(problems)), "pairs": float(len(pairs)),
            "chosen_reward_sum": float(sum(rewards[c] for c, _ in pairs)),
            "rejected_reward_sum": float(sum(rewards[r] for _, r in pairs))}
    return Rollout([samples[i] for pair in pairs for i in pair], rewards, version, info=info,
                   seconds=time.perf_counter() - t0, reward_terms=scores)


def _deal(rollout: Rollout) -> tuple[list[tuple[list[int], int]], list[ImageInputs | None], int]:
    """Every data-parallel rank's pairs gathered, then this rank's share ``all[dp_rank::dp]`` as
    DPO rows ``[(chosen ids, prompt len), (rejected ids, prompt len), ...]`` with each row's images
    (the prompt's :class:`alignment.data.images.ImageInputs`, or None); and the global count."""
    from megatron.core import parallel_state as ps

    group = ps.get_data_parallel_group()
    s = rollout.samples
    mine = [(list(s[i].prompt_ids), s[i].response_ids, s[i + 1].response_ids, s[i].images) for i in range(0, len(s), 2)]
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, mine, group=group)
    everyone = [pair for part in gathered for pair in part]
    share = everyone[dist.get_rank(group)::dist.get_world_size(group)]
    rows = [row for prompt, c, r, _ in share for row in ((prompt + c, len(prompt)), (prompt + r, len(prompt)))]
    return rows, [im for *_, im in share for _ in range(2)], len(everyone)


def update_reference(models: Models, step: int, cfg: JobConfig) -> int:
    """``algorithm.ref_update=iteration``: at the first step of every iteration (``step`` a
    multiple of ``algorithm.iteration_steps``, not 0) copy the policy's weights into the reference;
    returns the version of the policy the reference now holds (the step it was copied at; 0: the
    initial policy)."""

    a = cfg.algorithm
    if a.ref_update != "iteration":
        return 0
    version: int = step // a.iteration_steps * a.iteration_steps
    if version and step == version:
        models.placement.keep("policy", "reference")
        with torch.no_grad():
            policy = dict(unwrap(models.policy).named_parameters())
            for name, p in unwrap(cast(torch.nn.Module, models.reference)).named_parameters():
                p.copy_(policy[name])
    return version


def train(models: Models, rollout: Rollout, cfg: JobConfig) -> tuple[dict[str, float], dict[str, float]]:
    """The trainer step on this DP rank's pairs (see the module docstring). Returns (global
    metrics, phase seconds): ``online_dpo/pairs`` (global), ``online_dpo/tie_fraction`` (prompts
    without a pair), ``online_dpo/ref_version``, the objective's ``dpo/loss``, ``dpo/accuracy``,
    ``dpo/margin`` (implicit rewards), ``grad_norm`` (0 without an update), the judge's
    ``reward/mean`` over every sample and ``reward/chosen`` / ``reward/rejected`` over the pairs."""

    a, times = cfg.algorithm, {}
    t0 = time.perf_counter()
    ref_version = update_reference(models, rollout.step, cfg)
    rows, images, total = _deal(rollout)
    from megatron.core import parallel_state as ps

    dp = ps.get_data_parallel_world_size()
    objective = DPOObjective(models.vocab_size, a.beta, a.loss_type, a.label_smoothing, a.simpo_gamma, a.orpo_lambda)
    mb = MicroBatching.from_trainer(cfg.trainer, rows_per_unit=objective.rows_per_example)
    metrics = {"grad_norm": 0.0}
    updated = total >= dp * (2 if a.loss_type == "kto" else 1)  # every rank has pairs (KTO: two, for its z0)
    if updated:
        pad = models.tokenizer.pad_token_id if models.tokenizer.pad_token_id is not None else 0
        models.placement.keep("reference")
        batch = build_batch(rows, pad, models, objective, mb, images)
        times["logprobs"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        models.placement.keep(*trainable("policy"))
        metrics = {f"dpo/{k}": v for k, v in train_step(models, objective, batch, mb).items()}
        metrics["grad_norm"] = metrics.pop("dpo/grad_norm")
    times["train"] = time.perf_counter() - t0

    leader = replica_group().rank() == 0  # one contribution per data-parallel replica
    info = rollout.info
    keys = ("prompts", "pairs", "chosen_reward_sum", "rejected_reward_sum")
    sums = dict(zip(keys, all_reduce_sum([info[k] if leader else 0.0 for k in keys])))
    n, r_sum, tokens = all_reduce_sum([float(rollout.rewards.numel()) if leader else 0.0,
                                       rollout.rewards.sum().item() if leader else 0.0,
                                       float(sum(len(x) for x, _ in rows)) if leader and updated else 0.0])
    pairs = max(sums["pairs"], 1.0)
    metrics.update({"online_dpo/pairs": float(total), "online_dpo/tie_fraction": 1.0 - total / sums["prompts"],
                    "online_dpo/ref_version": float(ref_version), "reward/mean": r_sum / max(n, 1.0),
                    "reward/chosen": sums["chosen_reward_sum"] / pairs,
                    "reward/rejected": sums["rejected_reward_sum"] / pairs, "tokens": tokens,
                    **term_metrics(rollout.reward_terms, leader)})
    return metrics, times

