"""On-policy distillation (``algorithm.name=distill``), built on GRPO's step: its trainer (:func:`collect`,
:func:`train`) and its loss term (:class:`DistillTerms`, GRPO's :class:`alignment.trainers.grpo.StepTerms`).

The student (the policy) samples from its rollout engine exactly as in GRPO (:func:`alignment.trainers.grpo.collect`,
the task's rewards computed and logged; ``algorithm.distill_samples``: or the teacher's engine, or the dataset's
answers); the frozen teacher (``model.teacher_path``, built at the policy's layout and offloaded between phases
like the reference) then scores the student's tokens (:func:`teacher_scores`), and each micro-batch's loss gains
the distillation term (:func:`distill_terms`):

- ``reverse_kl``: per-token advantages ``log pi_T - log pi_S`` added to ``algorithm.task_reward_weight`` x
  the task's group advantages, trained by the GRPO policy loss (clipping, rollout correction, KL to the
  reference as configured);
- ``jsd`` / ``forward_kl``: GKD's generalized JSD (``algorithm.distill_beta``; 0 for forward KL) of the two
  whole distributions at every response position, aggregated like the policy loss
  (``algorithm.loss_agg_mode`` over the global batch) and added to it.

The math is :mod:`alignment.algorithms.distill_loss`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import torch

from alignment.algorithms.aggregation import aggregate
from alignment.algorithms.config import DistillConfig, has_section
from alignment.algorithms.distill_loss import FULL_DISTRIBUTION, generalized_jsd, jsd_beta, reverse_kl_advantages
from alignment.config import JobConfig
from alignment.data.tasks import Problem
from alignment.trainers import grpo
from alignment.trainers.models import Models
from alignment.trainers.rl_phases import Rollout, microbatches, policy_logprobs
from alignment.training.megatron_step import LogprobOutputs, VocabOutputs

#: the metric sums :func:`distill_terms` adds to a micro-batch's metrics
SUMS = ("distill_kl_sum", "distill_divergence_sum")


def collect(models: Models, problems: list[Problem], cfg: JobConfig, version: int = 0,
            refill: Callable[[int], list[Problem]] | None = None) -> Rollout:
    """GRPO's collector (:func:`alignment.trainers.grpo.collect`): the student samples (or, with
    ``algorithm.distill_samples=teacher``, the teacher's engine; with ``dataset``, each problem's answer in
    ``data.response_key`` is taken, no engine runs), the task's rewards computed and logged."""
    answers = (lambda todo: [str(p.columns[cfg.data.response_key]) for p in todo]) \
        if cfg.algorithm.distill_samples == "dataset" else None
    return grpo.collect(models, problems, cfg, version, refill, answers)


def train(models: Models, rollout: Rollout, cfg: JobConfig) -> tuple[dict[str, float], dict[str, float]]:
    """GRPO's step (:func:`alignment.trainers.grpo.train`) on the task's advantages weighted by
    ``algorithm.task_reward_weight`` (none at 0), the teacher's scores of the tokens (:func:`teacher_scores`)
    and the distillation term (:class:`DistillTerms`). Returns (global metrics, phase seconds)."""
    a = cfg.algorithm
    advantages = grpo.sample_advantages(rollout, cfg) * a.task_reward_weight if a.task_reward_weight \
        else torch.zeros_like(rollout.rewards, dtype=torch.float32)  # distillation only: no task advantages
    return grpo.train(models, rollout, cfg, advantages,
                      score=lambda batch, **packing: teacher_scores(models, batch, cfg, **packing),
                      terms=DistillTerms(a, full_distribution(cfg)))


class DistillTerms:
    """The distillation term of GRPO's step (:class:`alignment.trainers.grpo.StepTerms`): ``algorithm``, the
    job's section; ``full``: a whole-distribution loss (the student's forward computes vocabulary logprobs)."""

    sums: tuple[str, ...] = SUMS

    def __init__(self, algorithm: DistillConfig, full: bool) -> None:
        self.algorithm, self.full = algorithm, full

    def outputs(self, vocab_size: int, temperature: float) -> VocabOutputs | LogprobOutputs:
        return VocabOutputs(vocab_size, temperature) if self.full else \
            LogprobOutputs(vocab_size, temperature, entropy=True)

    def micro_batch(self, mb: dict[str, torch.Tensor], out: dict[str, torch.Tensor], old_logprobs: torch.Tensor,
                    normalizer: float) -> tuple[torch.Tensor, torch.Tensor | None, dict[str, torch.Tensor]]:
        return distill_terms(mb, out, old_logprobs, normalizer, self.algorithm)

    def metrics(self, sums: dict[str, float], tokens: float) -> dict[str, float]:
        return {"distill/reverse_kl": sums["distill_kl_sum"] / tokens,
                "distill/divergence": sums["distill_divergence_sum"] / tokens}


def full_distribution(cfg: JobConfig) -> bool:
    """Whether this job's distillation loss compares whole distributions (``jsd``, ``forward_kl``)."""
    return has_section(cfg.algorithm, DistillConfig) and cfg.algorithm.distill_loss in FULL_DISTRIBUTION


def teacher_scores(models: Models, batch: dict[str, torch.Tensor], cfg: JobConfig, packing: bool, share_prompts: bool
                   ) -> None:
    """The teacher's forward pass over the batch the student trains on: adds ``teacher_logprobs``
    ``[N, seq]`` (its log-probability of each sampled token, at the rollout's temperature) for
    ``reverse_kl``, or ``teacher_vocab_logprobs`` ``[N, seq, V]`` (fp32, zeros off the response) for the
    whole-distribution losses, on the last pipeline stage (zeros, or nothing, elsewhere: only that stage
    computes losses). With ``algorithm.distill_samples=dataset`` (no engine sampled the tokens) the
    teacher's logprobs also replace ``rollout_logprobs``, as its engine's do with ``teacher`` samples, so
    ``token_mult_prob_error`` is the student's distance to the teacher in both. Collective over the
    model-parallel groups."""
    models.placement.keep("teacher")
    mbs = microbatches(batch, cfg.trainer)
    full = full_distribution(cfg)
    out = policy_logprobs(cast(torch.nn.Module, models.teacher), mbs, models.vocab_size, cfg.rollout.temperature,
                          packing=packing, share_prompts=share_prompts, distribution=full)
    if full:
        if out is not None:
            batch["teacher_vocab_logprobs"] = out
            if cfg.algorithm.distill_samples == "dataset":  # no engine sampled: the teacher's logprobs stand in
                batch["rollout_logprobs"] = sampled_logprobs(out, batch["input_ids"]) * batch["response_mask"]
    else:
        batch["teacher_logprobs"] = out if out is not None else torch.zeros_like(batch["response_mask"])


def sampled_logprobs(vocab_logprobs: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """``[N, seq]``: at each position ``t`` the log-probability ``vocab_logprobs [N, seq, V]`` gives the
    next token ``input_ids[:, t + 1]`` (the last column wraps around: off every response)."""
    targets = torch.roll(input_ids, -1, dims=1).unsqueeze(-1)
    return vocab_logprobs.gather(-1, targets.clamp(0, vocab_logprobs.shape[-1] - 1)).squeeze(-1)


def distill_terms(mb: dict[str, torch.Tensor], out: dict[str, torch.Tensor], old_logprobs: torch.Tensor,
                  normalizer: float, algorithm: DistillConfig
                  ) -> tuple[torch.Tensor, torch.Tensor | None, dict[str, torch.Tensor]]:
    """One micro-batch's distillation term.

    Args:
        mb: the micro-batch: ``advantages`` ``[mbs]`` or ``[mbs, seq]`` (the task's share, already
            weighted), ``response_mask`` and ``input_ids`` ``[mbs, seq]``, and :func:`teacher_scores`' key.
        out: the student's outputs (``vocab_logprobs`` ``[mbs, seq, V]`` for the whole-distribution losses).
        old_logprobs: ``[mbs, seq]`` the sampling student's log-probabilities (no gradient).
        normalizer: the global normaliser of ``algorithm.loss_agg_mode``.
        algorithm: the ``algorithm`` config (``distill_loss``, ``distill_beta``, ``loss_agg_mode``).
    Returns:
        ``(advantages [mbs, seq], extra loss or None, metrics)``: the advantages the policy loss uses, the
        divergence loss to add (whole-distribution losses), and the sums ``distill_kl_sum`` (the sampled
        tokens' ``log pi_S - log pi_T``: an estimate of KL(student || teacher)) and
        ``distill_divergence_sum`` (the whole-distribution divergence; 0 for ``reverse_kl``).
    """
    mask = mb["response_mask"]
    adv = mb["advantages"]
    adv = adv[:, None] * mask if adv.dim() == 1 else adv
    if "teacher_logprobs" in mb:
        gain = reverse_kl_advantages(mb["teacher_logprobs"], old_logprobs.detach(), mask)
        return adv + gain, None, {"distill_kl_sum": -gain.sum(), "distill_divergence_sum": torch.zeros(())}
    teacher = mb["teacher_vocab_logprobs"]
    div = generalized_jsd(out["vocab_logprobs"], teacher, jsd_beta(algorithm.distill_loss, algorithm.distill_beta))
    with torch.no_grad():  # position t scores token t + 1
        teacher_lp = sampled_logprobs(teacher, mb["input_ids"])
        metrics = {"distill_kl_sum": ((old_logprobs.detach() - teacher_lp) * mask).sum(),
                   "distill_divergence_sum": (div.detach() * mask).sum()}
    return adv, aggregate(div, mask, algorithm.loss_agg_mode, normalizer), metrics
