"""PPO with a critic and a learned reward model (Ouyang et al. 2022, InstructGPT; the
token-level formulation of Ziegler et al. 2019 as in verl / OpenRLHF).

:func:`collect` (the rollout collector):
  1. rollout    — the rollout engine (``rollout.backend``) samples ``group_size`` responses per prompt
  2. score      — ``reward.functions`` (default: the frozen reward model's score of prompt +
                  response at its last token; :mod:`alignment.trainers.rewarding`)
:func:`train` (the trainer step):
  3. forward    — old_logprobs (policy), ref_logprobs (reference), values (critic), no grad
  4. advantages — per-token reward = -kl_coef * (old_logprobs - ref_logprobs), plus the score at
                  the last token (KL in the reward); GAE(gamma, gae_lambda); advantages whitened
                  over the global batch
  5. train      — the critic, then the policy (as verl; advantages are fixed, so the order
                  changes nothing): ``ppo_epochs`` passes over ``num_mini_batches``
                  mini-batches, clipped value loss / clipped surrogate, one Adam step per
                  mini-batch, every loss token-mean over the global mini-batch
The loop (:mod:`launchers.loop`) then syncs the new policy weights into the engine.
With ``trainer.offload`` each phase keeps on the device only the models it uses.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any, cast

import torch

from alignment.algorithms.advantages import gae
from alignment.algorithms.grpo_loss import GRPOLossConfig, grpo_loss
from alignment.algorithms.kl import kl_in_reward
from alignment.algorithms.process_rewards import place_step_rewards, to_batch_columns
from alignment.algorithms.value_loss import value_loss
from alignment.config import JobConfig
from alignment.data.images import select_rows
from alignment.rewards.code_runs import early_grading
from alignment.rewards.policy import ppo_on_task, process_reward_weight
from alignment.data.samples import SamplingConfig
from alignment.rollout.base import RolloutEngine
from alignment.trainers.models import Models
from alignment.trainers.process_rewarding import score_steps, step_metrics
from alignment.trainers.rewarding import combine, job_terms, padded_batch, score_terms, term_metrics
from alignment.trainers.agent_rollout import AGENT_COUNTS, agent_episodes, uses_agents
from alignment.trainers.rl_phases import (PassLayout, Rollout, correction_metrics, episode_metrics,
                                          generate_episodes, generate_for_group, head_outputs, microbatches,
                                          policy_logprobs, rollout_phase, sampling_config)
from alignment.training.config import shares_prompts
from alignment.training.dp_balance import balance_over_dp
from alignment.training import grad_stats
from alignment.training.health import guarded_step
from alignment.training.megatron_step import (LogprobOutputs, all_reduce_sum, forward_backward, global_sums,
                                              is_output_rank, value_outputs)
from alignment.training.offload import trainable
from alignment.training.router_stats import routing_metrics
from parallel.state import replica_group


def _ps() -> Any:
    from megatron.core import parallel_state as ps

    return ps


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, group: torch.distributed.ProcessGroup) -> torch.Tensor:
    """``(x - mean) / (std + 1e-8)`` over the valid tokens of the whole global batch (all DP ranks
    of ``group``), 0 elsewhere. ``std`` is the unbiased (Bessel-corrected) sample std over the
    ``n`` valid tokens, as verl's ``masked_whiten`` (``masked_var(unbiased=True)``) and
    megalign's group estimators; OpenRLHF divides by the population std. ``x``, ``mask``:
    ``[batch, seq]``; collective over ``group``."""
    n, s1, s2 = all_reduce_sum([mask.sum().item(), (x * mask).sum().item(), (x * x * mask).sum().item()], group)
    mean = s1 / n
    std = max((s2 - n * mean * mean) / (n - 1), 0.0) ** 0.5 if n > 1 else 0.0
    return (x - mean) / (std + 1e-8) * mask


def _train_critic(models: Models, mb_list: list[dict[str, torch.Tensor]], normalizer: float, value_clip: float | None,
                  packing: PassLayout) -> tuple[list[dict[str, torch.Tensor]], bool]:
    def loss_fn(mb: dict[str, torch.Tensor], out: dict[str, torch.Tensor]
                ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        per_token = value_loss(out["values"], mb["values"], mb["returns"], value_clip)
        mask = mb["response_mask"]
        return (per_token * mask).sum() / normalizer, {"value_loss_sum": (per_token.detach() * mask).sum()}

    critic = cast(torch.nn.Module, models.critic)  # PPO's value model
    critic.zero_grad_buffer()  # type: ignore[operator]  # Megatron DDP's method, unknown to torch.nn.Module
    models.critic_optimizer.zero_grad()
    out = forward_backward(critic, mb_list, loss_fn, outputs=value_outputs, forward_only=False, **packing)
    applied, _ = guarded_step(critic, models.critic_optimizer)
    return out, applied


def _train_policy(models: Models, mb_list: list[dict[str, torch.Tensor]], normalizer: float, loss_cfg: GRPOLossConfig,
                  temperature: float, packing: PassLayout, target_kl: float | None = None
                  ) -> tuple[list[dict[str, torch.Tensor]], float, bool, bool]:
    """One policy update on a mini-batch; returns (loss outputs, gradient norm, applied, stopped):
    ``stopped`` when ``target_kl`` is set and the mini-batch's approximate KL from the sampling policy
    exceeds 1.5 x ``target_kl`` (no update then; the caller ends the step's epochs)."""
    def loss_fn(mb: dict[str, torch.Tensor], out: dict[str, torch.Tensor]
                ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        entropy_sum = (out["entropy"] * mb["response_mask"]).sum()
        lp = out["logprobs"]
        loss, m = grpo_loss(lp, mb["old_logprobs"], None, mb["advantages"], mb["response_mask"], normalizer, loss_cfg,
                            rollout_logprobs=mb["rollout_logprobs"])
        m["entropy_sum"] = entropy_sum
        return loss, m

    models.policy.zero_grad_buffer()  # type: ignore[operator]  # Megatron DDP's method, unknown to torch.nn.Module
    models.optimizer.zero_grad()
    out = forward_backward(models.policy, mb_list, loss_fn, forward_only=False, **packing,
                           outputs=LogprobOutputs(models.vocab_size, temperature, entropy=True),
                           positions="response_mask")
    if target_kl is not None:  # Spinning Up's PPO: stop before the update that would leave the trust region
        sums = global_sums(out, ["approx_kl_sum", "tokens"])
        if sums["approx_kl_sum"] / max(sums["tokens"], 1.0) > 1.5 * target_kl:
            return out, float("nan"), True, True
    applied, grad_norm = guarded_step(models.policy, models.optimizer, grad_stats.requested())
    return out, grad_norm, applied, False


def request(prompts: list[list[int]], cfg: JobConfig) -> tuple[list[list[int]], SamplingConfig]:
    """What PPO asks the engine for ``prompts`` (token ids): ``group_size`` samples each at the
    rollout's sampling settings."""
    return prompts, sampling_config(cfg.rollout)


def collect(models: Models, items: list[Any], cfg: JobConfig, version: int = 0) -> Rollout:
    """The rollout collector: ``group_size`` responses to each of this DP rank's ``items`` by the
    policy of ``version`` optimizer steps, rewarded by ``reward.functions``: chat prompts (token
    ids) judged by the frozen reward model (its scores summed over the pipeline group onto every
    stage), or, PPO on a task (:func:`alignment.config.ppo_on_task`), ``data.task``'s problems run as
    episodes of ``rollout.environment`` (:func:`alignment.trainers.rl_phases.generate_episodes`) and
    graded by the text terms. The padded batch rides along."""
    t0 = time.perf_counter()
    info: dict[str, float]
    terms, info = job_terms(cfg), {}
    if ppo_on_task(cfg):  # text terms only: scored where the problems are, then the rewards travel with the samples
        with early_grading([t.runs for t in terms], items) as (pool, on_done):  # code runs as answers come
            with rollout_phase(models):
                if uses_agents(cfg):  # agent programs play the episodes against the rollout server
                    groups, info = agent_episodes(models, items, cfg.rollout.group_size, cfg.rollout.max_tokens)
                else:
                    groups = generate_episodes(models, items, sampling_config(cfg.rollout), on_done)
            samples = [s for g in groups for s in g]
            problems = [p for p in items for _ in range(cfg.rollout.group_size)]
            scores = score_terms(models, problems, samples, terms, cfg, pool=pool)
        rewards = combine(scores, terms, len(samples))
        if cfg.trainer.balance_batch:
            samples, (rewards, *values) = balance_over_dp(samples, [rewards, *scores.values()])
            scores = dict(zip(scores, values))
        batch = padded_batch(models, samples)
    else:
        with rollout_phase(models):
            groups = generate_for_group(cast(RolloutEngine, models.engine), *request(items, cfg))
        samples = [s for g in groups for s in g]
        if cfg.trainer.balance_batch:  # nothing is per group in PPO: re-deal the sequences by token count now
            samples, _ = balance_over_dp(samples, [])
        batch = padded_batch(models, samples)
        scores = score_terms(models, [None] * len(samples), samples, terms, cfg, batch)
        rewards = combine(scores, terms, len(samples))
    steps = score_steps(models, samples, cfg) if process_reward_weight(cfg) else None  # the dense term
    return Rollout(samples, rewards, version, batch=batch, info=info, seconds=time.perf_counter() - t0,
                   reward_terms=scores, steps=steps)


def train(models: Models, rollout: Rollout, cfg: JobConfig) -> tuple[dict[str, float], dict[str, float]]:
    """The trainer step on this DP rank's ``rollout``: old/ref logprobs and values, KL-in-reward
    GAE advantages, then the critic and the policy updates. Returns (global metrics, phase seconds)."""

    ps = _ps()
    a, r, t = cfg.algorithm, cfg.rollout, cfg.trainer
    dp_group = ps.get_data_parallel_group()
    times: dict[str, float] = {}
    batch, rewards = cast(dict[str, torch.Tensor], rollout.batch), rollout.rewards  # collect's padded batch
    t0 = time.perf_counter()
    packing: PassLayout = dict(packing=t.sequence_packing, share_prompts=shares_prompts(cfg))  # forward_backward's layout
    mask = batch["response_mask"]
    zeros = torch.zeros_like(mask)
    models.placement.keep("policy")
    old = policy_logprobs(models.policy, microbatches(batch, cfg.trainer), models.vocab_size, r.temperature, **packing)
    old = old if old is not None else zeros
    models.placement.keep("reference")
    ref = zeros if models.reference is None else policy_logprobs(
        models.reference, microbatches(batch, cfg.trainer), models.vocab_size, r.temperature, **packing)
    ref = ref if ref is not None else zeros
    models.placement.keep("critic")
    values = head_outputs(cast(torch.nn.Module, models.critic), microbatches(batch, cfg.trainer), **packing)
    values = values * mask if values is not None else zeros
    live = mask.bool().any(dim=1)  # a dropped agent episode (its group failed) has no token to reward
    token_rewards = torch.zeros_like(old)
    token_rewards[live] = kl_in_reward(rewards[live], old[live], ref[live], mask[live], a.kl_coef, "k1")
    if rollout.steps is not None:  # the process reward: P(step correct) on each step's last token
        s = rollout.steps
        dense = place_step_rewards(s.rewards, s.positions, [len(x.response_ids) for x in rollout.samples])
        token_rewards = token_rewards + s.weight * to_batch_columns(
            dense, [len(x.prompt_ids) for x in rollout.samples], mask.shape[1]) * mask
    advantages, returns = gae(token_rewards, values, mask, a.gamma, a.gae_lambda)
    batch.update(old_logprobs=old, values=values, returns=returns,
                 advantages=masked_whiten(advantages, mask, dp_group) if a.whiten_advantages else advantages)
    times["logprobs"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    # the KL is in the reward (kl_in_reward), the loss a token mean over the mini-batch's tokens
    loss_cfg = replace(GRPOLossConfig.from_algorithm(a), kl_coef=0.0, loss_agg_mode="token-mean")
    n = batch["input_ids"].shape[0]
    size = n // a.num_mini_batches
    minis = []
    for k in range(a.num_mini_batches):
        mini = select_rows(batch, torch.arange(k * size, (k + 1) * size))  # with the rows' images
        [tokens] = all_reduce_sum([mini["response_mask"].sum().item()], dp_group)
        minis.append((microbatches(mini, cfg.trainer), tokens))
    policy_out, critic_out, grad_norms, skipped = [], [], [], 0
    models.placement.keep(*trainable("critic"))
    for _ in range(a.ppo_epochs):
        for mb_list, tokens in minis:
            out, applied = _train_critic(models, mb_list, tokens, a.value_clip, packing)
            critic_out += out
            skipped += not applied
    # MoE critic; before the policy trains
    critic_routing = routing_metrics(cast(torch.nn.Module, models.critic), prefix="moe_critic")
    models.placement.keep(*trainable("policy"))
    policy_updates, stopped = 0, False
    for _ in range(a.ppo_epochs):
        for mb_list, tokens in minis:
            out, norm, applied, stopped = _train_policy(models, mb_list, tokens, loss_cfg, r.temperature, packing,
                                                        a.target_kl)
            policy_out += out
            if stopped:  # algorithm.target_kl: the rest of this step's epochs are skipped
                break
            grad_norms += [norm] if applied else []
            skipped += not applied
            policy_updates += 1
        if stopped:
            break
    times["train"] = time.perf_counter() - t0

    # Global statistics: policy/critic sums counted once per replica; batch statistics once per DP rank.
    p, c = global_sums(policy_out), global_sums(critic_out)
    # (values, logprobs and scores live on the last pipeline stage; TP ranks hold copies)
    keep = 1.0 if is_output_rank() else 0.0
    resid = (returns - values) * mask
    prob_error = torch.exp((old - batch["rollout_logprobs"]).abs()) * mask  # vLLM vs trainer, same weights
    tok, s_r, s_r2, s_e, s_e2, kl, n_seq, r_sum, r_sq, length, perr, tokens = all_reduce_sum([keep * v for v in [
        mask.sum().item(), (returns * mask).sum().item(), (returns ** 2 * mask).sum().item(),
        resid.sum().item(), (resid ** 2).sum().item(), ((old - ref) * mask).sum().item(),
        float(n), rewards.sum().item(), (rewards ** 2).sum().item(), batch["response_lengths"].sum().item(),
        prob_error.sum().item(), batch["seq_lengths"].sum().item()]])
    var_r = s_r2 / tok - (s_r / tok) ** 2
    var_e = s_e2 / tok - (s_e / tok) ** 2
    updates = a.ppo_epochs * a.num_mini_batches
    mean_r = r_sum / n_seq
    metrics = {
        "reward/mean": mean_r, "reward/std": max(r_sq / n_seq - mean_r ** 2, 0.0) ** 0.5,
        "kl": kl / tok, "response_length": length / n_seq, "tokens": tokens,
        "loss/policy": p["policy_loss_sum"] / max(p["tokens"], 1.0),
        "loss/value": c["value_loss_sum"] / max(tok * updates, 1.0),
        "clip_fraction": p["clipped_tokens"] / max(p["tokens"], 1.0),
        "entropy": p["entropy_sum"] / max(p["tokens"], 1.0),
        "explained_variance": 1.0 - var_e / var_r if var_r > 0 else 0.0,
        "grad_norm": sum(grad_norms) / len(grad_norms) if grad_norms else float("nan"),
        "health/skipped_updates": float(skipped),  # policy and critic updates with NaN/inf gradients
        "ppo/policy_updates": float(policy_updates), "approx_kl": p["approx_kl_sum"] / max(p["tokens"], 1.0),
        "token_mult_prob_error": perr / tok,
        **correction_metrics(policy_out, max(p["tokens"], 1.0)),
        **routing_metrics(models.policy),  # MoE: expert load imbalance, aux loss
        **critic_routing,
        **term_metrics(rollout.reward_terms, replica_group().rank() == 0),
        **step_metrics(rollout.steps, replica_group().rank() == 0),
    }
    if cfg.rollout.environment != "single_turn" or uses_agents(cfg):
        metrics.update(episode_metrics(rollout.samples, replica_group().rank() == 0))
    metrics.update({k: rollout.info[k] for k in AGENT_COUNTS if k in rollout.info})  # global sums already
    return metrics, times
