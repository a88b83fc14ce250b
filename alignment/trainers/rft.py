"""Rejection-sampling fine-tuning: STaR (Zelikman et al. 2022, "STaR: Bootstrapping Reasoning
With Reasoning", Alg. 1) and RFT (Yuan et al. 2023, "Scaling Relationship on Learning
Mathematical Reasoning with Large Language Models", Sec. 3.2). The loop around it is
:mod:`launchers.loop`: one step is one iteration on ``rollout.prompts_per_step`` problems.

:func:`collect` (the rollout collector):
  1. sample    — ``rollout.group_size`` answers per problem (the rollout engine, as GRPO)
  2. reward    — ``reward.functions`` (default: the task's grader)
  3. filter    — keep the answers with reward >= ``algorithm.accept_threshold``, each distinct
                 response once per problem (``algorithm.dedup_responses``)
  4. rationalise (``algorithm.rationalize``) — the problems with no kept answer are asked again
                 with the answer as a hint; the accepted answers are kept as answers to the
                 question *without* the hint (STaR Sec. 3.2)
:func:`train` (the trainer step): next-token NLL on the kept responses (prompt tokens masked),
token mean over the global batch, one Adam step; the weights then sync into the engine, so the
next iteration samples from the fine-tuned policy. STaR restarts each iteration's fine-tuning
from the base model; here the policy keeps training (RFT's and ReST-EM's online variant), which
needs no growing dataset and fits the RL loop's checkpoints and resume.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import cast

import torch

from alignment.algorithms.rejection_sampling import accepted_indices
from alignment.algorithms.sft_loss import sft_loss
from alignment.config import JobConfig
from alignment.data.prompts import PromptStyle, build_prompt_ids
from alignment.data.tasks import Problem
from alignment.rewards.code_runs import early_grading
from alignment.data.samples import Sample, SamplingConfig
from alignment.rollout.base import RolloutEngine
from alignment.rollout.engines.image_prompts import image_prompts, images_of
from alignment.trainers.models import Models
from alignment.trainers.rewarding import combine, job_terms, score_terms, term_metrics
from alignment.trainers.rl_phases import (Rollout, generate_for_group, image_processor, microbatches, rollout_phase,
                                         sampling_config)
from alignment.training.batching import make_batch
from alignment.training.config import shares_prompts
from alignment.training import grad_stats
from alignment.training.health import guarded_step
from alignment.training.megatron_step import LogprobOutputs, all_reduce_sum, forward_backward, is_output_rank
from alignment.training.offload import trainable
from parallel.state import replica_group


def _sample_and_accept(models: Models, problems: list[Problem], prompts: list[list[int]], sampling: SamplingConfig,
                       cfg: JobConfig) -> tuple[list[Sample], dict[str, torch.Tensor], torch.Tensor, list[list[int]]]:
    """Sample ``group_size`` answers to ``prompts`` (one per problem), reward them as answers to
    ``problems``; returns ``(samples, scores, rewards, kept indices per problem)``. Collective."""
    a, r = cfg.algorithm, cfg.rollout
    terms = job_terms(cfg)
    with early_grading([t.runs for t in terms], problems) as (pool, on_done):  # code runs start as answers come
        # collective even with no prompts
        groups = generate_for_group(cast(RolloutEngine, models.engine), prompts, sampling, on_done)
        samples = [s for g in groups for s in g]
        if not samples:
            return [], {}, torch.zeros(0), [[] for _ in problems]
        scores = score_terms(models, [p for p in problems for _ in range(r.group_size)], samples, terms, cfg,
                             pool=pool)
    rewards = combine(scores, terms, len(samples))  # no whitened terms (refused by the config check): no collective
    texts = [s.text for s in samples] if a.dedup_responses else None
    return samples, scores, rewards, accepted_indices(rewards, r.group_size, a.accept_threshold, texts)


def collect(models: Models, problems: list[Problem], cfg: JobConfig, version: int = 0,
            refill: Callable[[int], list[Problem]] | None = None) -> Rollout:  # noqa: ARG001
    """This DP rank's iteration data: the accepted answers to its ``problems`` (``Rollout.samples``,
    possibly none; rewards of the kept ones), sampled by the policy of ``version`` optimizer steps.
    ``Rollout.info``: ``sampled``, ``accepted`` (before de-duplication), ``kept``, ``solved``
    (problems with a kept answer), ``rationalized`` (problems solved only with the hint) and
    ``problems``; ``Rollout.reward_terms``: every sampled answer's raw scores (hinted ones not).
    Collective over the model replica (and over every rank with ``algorithm.rationalize``). ``refill``: the
    loop's supply of more problems, unused (no dynamic sampling here)."""
    t0 = time.perf_counter()
    a, tok, style = cfg.algorithm, models.tokenizer, PromptStyle.of(cfg.data)
    images = image_processor(models)
    prompts = image_prompts(images, problems, [build_prompt_ids(tok, p, style) for p in problems])
    sampling = sampling_config(cfg.rollout)
    with rollout_phase(models):
        samples, scores, rewards, kept = _sample_and_accept(models, problems, prompts, sampling, cfg)
        accepted = int((rewards >= a.accept_threshold).sum()) if len(rewards) else 0
        chosen = [samples[i] for k in kept for i in k]
        chosen_rewards = [float(rewards[i]) for k in kept for i in k]
        own_lp = [x for smp in chosen for x in smp.logprobs]  # the sampler's, under the prompt trained on
        rationalized = 0
        if a.rationalize:  # every rank takes part, with no prompts when it solved everything
            failed = [j for j, k in enumerate(kept) if not k]
            hinted = image_prompts(images, [problems[j] for j in failed],
                                   [build_prompt_ids(tok, problems[j], style, hint=problems[j].answer) for j in failed])
            h_samples, _, h_rewards, h_kept = _sample_and_accept(models, [problems[j] for j in failed], hinted,
                                                                 sampling, cfg)
            for j, k in zip(failed, h_kept):
                rationalized += bool(k)
                for i in k:  # trained as an answer to the question without the hint
                    s = h_samples[i]
                    chosen.append(Sample(prompts[j], s.response_ids, s.logprobs, s.text, s.finished,
                                          weight_updates=s.weight_updates, images=images_of(prompts[j])))
                    chosen_rewards.append(float(h_rewards[i]))
    info = {"sampled": float(len(samples)), "reward_sum": float(rewards.sum()), "accepted": float(accepted),
            "kept": float(len(chosen)), "solved": float(sum(bool(k) for k in kept) + rationalized),
            "rationalized": float(rationalized), "problems": float(len(problems)),
            "sampler_lp_sum": float(sum(own_lp)), "sampler_tokens": float(len(own_lp))}
    return Rollout(chosen, torch.tensor(chosen_rewards), version, info=info,
                   seconds=time.perf_counter() - t0, reward_terms=scores)


def _placeholder(models: Models) -> Sample:
    """A one-token row for a rank with nothing kept: it runs the schedule with a zero loss mask,
    so every rank takes part in the step (the gradient all-reduce) and adds nothing."""
    eos = models.tokenizer.eos_token_id or 0
    return Sample([eos], [eos], [0.0], "", True)


def train(models: Models, rollout: Rollout, cfg: JobConfig) -> tuple[dict[str, float], dict[str, float]]:
    """One Adam step of next-token NLL on this DP rank's kept samples (token mean over the global
    batch's response tokens; no step when no rank kept anything). Returns (global metrics, phase
    seconds): ``rft/acceptance_rate`` (accepted / sampled), ``rft/solved_fraction``,
    ``rft/rationalized_fraction`` (of the problems), ``rft/kept`` (samples trained on),
    ``loss/sft`` (nats per token before the step), ``rft/sampler_nll`` (the same tokens' NLL under
    the engine's sampling distribution, hinted answers apart), ``grad_norm``, ``reward/mean`` (every sampled
    answer), ``reward/kept_mean``, ``reward/<name>`` per term, ``response_length`` (kept)."""
    from megatron.core import parallel_state as ps

    times, t0 = {}, time.perf_counter()
    leader = replica_group().rank() == 0  # one contribution per data-parallel replica
    real = bool(rollout.samples)
    batch = make_batch(rollout.samples or [_placeholder(models)], pad_id=models.tokenizer.pad_token_id or 0)
    batch["loss_mask"] = batch["response_mask"] * float(real)  # the placeholder's token weighs 0
    [tokens] = all_reduce_sum([batch["loss_mask"].sum().item()], ps.get_data_parallel_group())
    models.placement.keep(*trainable("policy"))
    loss_sum, grad_norm, skipped = 0.0, 0.0, 0.0
    if tokens > 0:  # every rank agrees: the sum is global
        def loss_fn(mb: dict[str, torch.Tensor], out: dict[str, torch.Tensor]
                    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
            lp, mask = out["logprobs"], mb["loss_mask"]
            return sft_loss(lp, mask, tokens), {"nll_sum": -(lp.detach() * mask).sum()}

        models.policy.zero_grad_buffer()  # type: ignore[operator]  # Megatron DDP's method, unknown to torch.nn.Module
        models.optimizer.zero_grad()
        out = forward_backward(models.policy, microbatches(batch, cfg.trainer), loss_fn, forward_only=False,
                               outputs=LogprobOutputs(models.vocab_size), packing=cfg.trainer.sequence_packing,
                               positions="response_mask", share_prompts=shares_prompts(cfg))
        applied, grad_norm = guarded_step(models.policy, models.optimizer, grad_stats.requested())
        skipped = float(not applied)
        loss_sum = sum(float(o["nll_sum"]) for o in out) if is_output_rank() else 0.0
    times["train"] = time.perf_counter() - t0
    info = rollout.info
    [nll] = all_reduce_sum([loss_sum])
    keys = ("sampled", "reward_sum", "accepted", "kept", "solved", "rationalized", "problems", "sampler_lp_sum",
            "sampler_tokens")
    sums = dict(zip(keys, all_reduce_sum([info[k] if leader else 0.0 for k in keys])))
    n_kept, r_sum, length, seq_tokens = all_reduce_sum([
        float(len(rollout.samples)) if leader else 0.0, rollout.rewards.sum().item() if leader and real else 0.0,
        batch["response_lengths"].sum().item() if leader and real else 0.0,
        batch["seq_lengths"].sum().item() if leader and real else 0.0])
    problems = max(sums["problems"], 1.0)
    metrics = {"rft/acceptance_rate": sums["accepted"] / max(sums["sampled"], 1.0),
               "rft/solved_fraction": sums["solved"] / problems,
               "rft/rationalized_fraction": sums["rationalized"] / problems,
               "rft/kept": n_kept, "loss/sft": nll / tokens if tokens else 0.0, "grad_norm": grad_norm,
               "health/skipped_updates": skipped,
               "reward/kept_mean": r_sum / n_kept if n_kept else 0.0,
               "response_length": length / n_kept if n_kept else 0.0, "tokens": seq_tokens,
               "reward/mean": sums["reward_sum"] / max(sums["sampled"], 1.0),  # of every sampled answer
               # the engine's NLL of the kept answers it sampled without a hint (at temperature 1: == loss/sft)
               "rft/sampler_nll": -sums["sampler_lp_sum"] / max(sums["sampler_tokens"], 1.0),
               **term_metrics(rollout.reward_terms, leader)}
    return metrics, times
