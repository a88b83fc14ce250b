"""GRPO (DeepSeekMath, Shao et al. 2024) on Megatron-Core, and its critic-free variants by
config: Dr.GRPO (``advantage_estimator=grpo_no_std``, ``loss_agg_mode=seq-mean-token-sum-norm``),
DAPO's clip-higher (``clip_ratio_high``) and dynamic sampling, RLOO (``rloo``) and REINFORCE++
(``reinforce_plus_plus[_baseline]``). The loop around it is :mod:`launchers.loop`.

:func:`collect` (the rollout collector):
  1. rollout   — the rollout engine (``rollout.backend``) samples ``group_size`` responses per prompt
  2. reward    — ``reward.functions`` (default: the task's grader), each term logged, whitened
                 over the global batch if asked, weighted and summed (+ DAPO's overlong penalty)
:func:`train` (the trainer step):
  3. advantage — group-normalised rewards (eq. in Sec. 4.1.2), or the estimator configured
  4. logprobs  — frozen reference model's logprobs (for the k3 KL term)
  5. train     — clipped surrogate + kl_coef * KL, normalised over the global batch, Adam steps
The loop then syncs the new weights into the engine (:func:`alignment.trainers.rl_phases.sync_weights`).
Agent programs, dynamic sampling, a process reward and MoE routing replay plug into these steps through the
named hooks of :mod:`alignment.trainers.grpo_hooks`.
With ``trainer.offload`` each phase keeps on the device only the models it uses
(``models.placement.keep``); the others wait in host memory.
Data layout: every data-parallel (DP) rank owns whole prompt groups; the ranks of one
model replica (TP x CP x PP) share the same data and split only its generation. With
``trainer.balance_batch`` the sequences are then re-dealt over DP ranks by token count.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any, Protocol, cast

import torch

from alignment.algorithms.advantages import BATCH_WHITENED, get_advantage_estimator
from alignment.algorithms.aggregation import global_normalizer
from alignment.algorithms.grpo_loss import GRPOLossConfig, grpo_loss
from alignment.algorithms.process_rewards import process_advantages, to_batch_columns
from alignment.config import JobConfig
from alignment.data.images import select_rows
from alignment.data.samples import Sample
from alignment.data.tasks import Problem
from alignment.rewards.code_runs import early_grading
from alignment.rollout.base import RolloutEngine
from alignment.rollout.engines.carryover import CarryOverPool
from alignment.rollout.engines.carried_remote import RemotePool
from alignment.trainers.agent_rollout import AGENT_COUNTS
from alignment.trainers.grpo_hooks import step_hooks
from alignment.trainers.models import Models
from alignment.trainers.process_rewarding import StepRewards, step_metrics
from alignment.trainers.rewarding import combine, job_terms, score_terms, term_metrics
from alignment.trainers.rl_phases import (PassLayout, ReplicaGeneration, Rollout, correction_metrics, episode_metrics,
                                          microbatches, policy_logprobs, rollout_phase)
from alignment.training.batching import make_batch
from alignment.training.config import shares_prompts
from alignment.training.dp_balance import balance_over_dp
from alignment.training import grad_stats
from alignment.training.health import guarded_step
from alignment.training.megatron_step import LogprobOutputs, all_reduce_sum, forward_backward, is_output_rank
from alignment.training.offload import trainable
from alignment.training.router_stats import routing_metrics
from alignment.training.routing_replay import RECORD, agreement_metrics
from parallel.state import replica_group


def _ps() -> Any:
    from megatron.core import parallel_state as ps

    return ps


def _model_tokens(batch: dict[str, torch.Tensor], cfg: JobConfig) -> int:
    """Real tokens one pass of the trainer runs the model on for ``batch``: prompt + response of
    every row, each micro-batch's shared prompts counted once with ``trainer.shared_prompt_packing``."""
    if not shares_prompts(cfg):
        return int(batch["seq_lengths"].sum())
    from parallel.prompt_tree import tree_tokens  # imports Megatron

    return sum(tree_tokens(mb["input_ids"], mb["seq_lengths"], mb["seq_lengths"] - mb["response_lengths"])
               for mb in microbatches(batch, cfg.trainer))


class StepTerms(Protocol):
    """A term an algorithm built on GRPO's step adds to each micro-batch's loss (on-policy distillation's:
    :class:`alignment.trainers.distill.DistillTerms`), given to :func:`train` / :func:`train_step`."""

    #: the metric sums :meth:`micro_batch` adds to each micro-batch's metrics
    sums: tuple[str, ...]

    def outputs(self, vocab_size: int, temperature: float) -> Any:
        """What the student's forward pass computes (:mod:`alignment.training.megatron_step`'s outputs)."""

    def micro_batch(self, mb: dict[str, torch.Tensor], out: dict[str, torch.Tensor], old_logprobs: torch.Tensor,
                    normalizer: float
                    ) -> tuple[torch.Tensor, torch.Tensor | None, dict[str, torch.Tensor]]:
        """``(advantages, extra loss or None, metric sums)`` of one micro-batch (shapes: ``mb``'s)."""

    def metrics(self, sums: dict[str, float], tokens: float) -> dict[str, float]:
        """The step's metrics of the global :attr:`sums`, over ``tokens`` response tokens."""


def train_step(models: Models, batch: dict[str, torch.Tensor], cfg: JobConfig, terms: StepTerms | None = None
               ) -> dict[str, float]:
    """``algorithm.ppo_epochs`` passes over ``algorithm.num_mini_batches`` mini-batches of this
    rank's share of the rollout batch, one Adam step per mini-batch; ``terms``: a loss term of the
    algorithm's own (:class:`StepTerms`). Returns global metrics averaged over the updates.

    With a single update the sampling policy is the current one, so ``old_logprobs`` are the
    current logprobs without gradient (ratio 1); otherwise they are ``batch["old_logprobs"]``,
    computed before the first update.
    """
    ps = _ps()
    a = cfg.algorithm
    loss_cfg = GRPOLossConfig.from_algorithm(a)
    size = batch["input_ids"].shape[0] // a.num_mini_batches
    routing = step_hooks(cfg).routes.in_updates(models.policy, batch)
    keys = ["policy_loss_sum", "kl_sum", "clipped_tokens", "entropy_sum", "prob_error_sum", "tokens",
            *(terms.sums if terms is not None else ())]
    local, grad_norms, outs, skipped = [0.0] * len(keys), [], [], 0
    for _ in range(a.ppo_epochs):
        for k in range(a.num_mini_batches):
            mini = select_rows(batch, torch.arange(k * size, (k + 1) * size))  # with the rows' images
            # The normaliser of the loss over the WHOLE global mini-batch (all micro-batches, all DP ranks).
            tokens, seqs = all_reduce_sum([mini["response_mask"].sum().item(), float(size)],
                                          ps.get_data_parallel_group())
            normalizer = global_normalizer(a.loss_agg_mode, tokens, seqs, cfg.rollout.max_tokens)

            def loss_fn(mb: dict[str, torch.Tensor], out: dict[str, torch.Tensor]
                        ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
                mask = mb["response_mask"]
                entropy_sum = (out["entropy"] * mask).sum()
                lp = out["logprobs"]
                old = mb["old_logprobs"] if "old_logprobs" in mb else lp.detach()
                advantages, extra, more = (terms.micro_batch(mb, out, old, normalizer) if terms is not None
                                           else (mb["advantages"], None, {}))
                loss, m = grpo_loss(lp, old, mb.get("ref_logprobs"), advantages, mask, normalizer, loss_cfg,
                                    rollout_logprobs=mb["rollout_logprobs"])
                if extra is not None:  # the algorithm's own term (distillation's whole-distribution loss)
                    loss = loss + extra
                m.update(more, entropy_sum=entropy_sum)
                with torch.no_grad():
                    m["prob_error_sum"] = (torch.exp((old - mb["rollout_logprobs"]).abs()) * mask).sum()
                return loss, m

            models.policy.zero_grad_buffer()  # type: ignore[operator]  # Megatron's DDP method
            models.optimizer.zero_grad()
            # The policy being optimised is the one vLLM samples from: softmax(logits / T).
            outputs = (terms.outputs(models.vocab_size, cfg.rollout.temperature) if terms is not None
                       else LogprobOutputs(models.vocab_size, cfg.rollout.temperature, entropy=True))
            out = forward_backward(models.policy, microbatches(mini, cfg.trainer), loss_fn, forward_only=False,
                                   outputs=outputs,
                                   packing=cfg.trainer.sequence_packing, positions="response_mask",
                                   share_prompts=shares_prompts(cfg), routing=routing)
            applied, grad_norm = guarded_step(models.policy, models.optimizer, grad_stats.requested())
            if applied:
                grad_norms.append(grad_norm)
            skipped += not applied
            local = [acc + sum(o[key].item() for o in out) for acc, key in zip(local, keys)]
            outs += out
    # Only one rank per model replica contributes (the last stage's TP rank 0, CP rank 0).
    if not is_output_rank():
        local = [0.0] * len(keys)
    sums = dict(zip(keys, all_reduce_sum(local)))
    n = max(sums.pop("tokens"), 1.0)
    return {
        **correction_metrics(outs, n),
        "loss/policy": sums["policy_loss_sum"] / n,
        "kl": sums["kl_sum"] / n,
        "clip_fraction": sums["clipped_tokens"] / n,
        "entropy": sums["entropy_sum"] / n,
        "token_mult_prob_error": sums["prob_error_sum"] / n,
        "grad_norm": sum(grad_norms) / len(grad_norms) if grad_norms else float("nan"),
        "health/skipped_updates": float(skipped),  # NaN/inf gradients: alignment/training/health.py
        **routing_metrics(models.policy),  # MoE: expert load imbalance, aux loss
        **(agreement_metrics(models.policy) if routing is not None else {}),  # MoE routing replay
        **(terms.metrics(sums, n) if terms is not None else {}),
    }


def sample_groups(models: Models, problems: list[Problem], cfg: JobConfig,
                  refill: Callable[[int], list[Problem]] | None = None,
                  answers: Callable[[list[Problem]], list[str]] | None = None
                  ) -> tuple[list[Sample], dict[str, torch.Tensor], dict[str, float]]:
    """Sample ``group_size`` responses per problem and score them with every reward term
    (``reward.functions``, plus DAPO's overlong penalty when ``algorithm.overlong_buffer_len > 0``;
    :func:`alignment.trainers.rewarding.job_terms`). With ``algorithm.dynamic_sampling`` (DAPO
    Sec. 3.2), groups whose rewards are all equal are set aside and ``refill(k)`` problems are
    sampled instead, for at most ``algorithm.max_sampling_rounds`` rounds; if still short, set-aside
    groups fill the batch (they have zero advantage). Always returns ``len(problems)`` groups.
    ``answers(problems)``: the responses to take instead of sampling (a dataset's: distillation on it); with a
    teacher engine (``models.teacher_engine``) the teacher samples.

    Returns:
        ``(samples, scores, info)``: ``scores`` name -> ``[N]`` raw scores of each term,
        ``info`` = {"rounds", "filled_groups"}, and with agent programs their
        :data:`alignment.trainers.agent_rollout.AGENT_COUNTS` (global sums).
    """
    a, g_size, hooks = cfg.algorithm, cfg.rollout.group_size, step_hooks(cfg)
    terms = job_terms(cfg)
    kept: list[tuple[list[Sample], dict[str, torch.Tensor]]] = []
    dropped: list[tuple[list[Sample], dict[str, torch.Tensor]]] = []
    rounds, todo, agents = 0, problems, cast(dict[str, float], {})
    functions = [t.runs for t in terms]
    while True:
        rounds += 1 if todo else 0
        with early_grading(functions, todo) as (pool, on_done):  # code runs start as answers are generated
            groups, counts = hooks.sample(models, todo, on_done, answers)
            for k, v in counts.items():  # agent programs' counts
                agents[k] = agents.get(k, 0.0) + v
            samples = [s for g in groups for s in g]
            # model terms are collective over the replica, whose ranks all hold these samples (or none)
            scores = score_terms(models, [p for p in todo for _ in range(g_size)], samples, terms, cfg,
                                 pool=pool) if samples else {}
        for i, g in enumerate(groups):
            part = {k: v[i * g_size: (i + 1) * g_size] for k, v in scores.items()}
            (kept if hooks.keep_group is None or hooks.keep_group(part) else dropped).append((g, part))
        missing = len(problems) - len(kept)
        more = missing > 0 and refill is not None and rounds < a.max_sampling_rounds
        # generation is collective (model-parallel groups, TP>1 engines): every rank keeps taking
        # part, with no prompts once it has enough, until no rank wants another round
        if not all_reduce_sum([float(more)])[0]:
            break
        todo = refill(missing) if more and refill is not None else []
    chosen = (kept + dropped)[: len(problems)]
    samples = [s for g, _ in chosen for s in g]
    scores = {t.name: torch.cat([part[t.name] for _, part in chosen]) for t in terms}
    return samples, scores, {"rounds": float(rounds), "filled_groups": float(max(len(problems) - len(kept), 0)),
                             **agents}


def collect(models: Models, problems: list[Problem], cfg: JobConfig, version: int = 0,
            refill: Callable[[int], list[Problem]] | None = None,
            answers: Callable[[list[Problem]], list[str]] | None = None,
            carried: CarryOverPool | RemotePool | None = None) -> Rollout:
    """The rollout collector: ``group_size`` sampled and rewarded responses for each of this DP
    rank's ``problems`` (``refill(k)`` supplies k more for dynamic sampling), by the policy of
    ``version`` optimizer steps (by the teacher's engine when the models have one; ``answers``: responses
    taken instead, no engine). See :func:`sample_groups`. ``carried``: partial rollouts carried across steps
    (``rollout.partial_carry_over``; ``problems`` admitted into it already): :func:`collect_carried`."""
    if carried is not None:
        return collect_carried(models, carried, len(problems), cfg, version)
    t, hooks = time.perf_counter(), step_hooks(cfg)
    phase = nullcontext() if answers is not None else rollout_phase(models, teacher=models.teacher_engine is not None)
    with phase:
        samples, scores, info = sample_groups(models, problems, cfg, refill if hooks.keep_group is not None else None, answers)
    rewards = combine(scores, job_terms(cfg), len(samples))  # whitened terms: over the global batch (collective)
    steps = hooks.dense(models, samples) if hooks.dense is not None else None  # the dense term
    return Rollout(samples, rewards, version, info=info, seconds=time.perf_counter() - t, reward_terms=scores,
                   steps=steps)


def collect_carried(models: Models, pool: CarryOverPool | RemotePool, groups: int, cfg: JobConfig, version: int
                    ) -> Rollout:
    """``rollout.partial_carry_over``: the pool's rows grown chunk by chunk by the engine holding the policy of
    ``version`` updates (rows too stale for it started again) until ``groups`` groups have finished, those taken
    (in admission order: the oldest prompts first) and rewarded. ``Rollout.version`` is the oldest version of any
    of their tokens, each sample's ``weight_updates`` its tokens' versions counted from there (so the loop's
    ``rollout/token_staleness`` is each token's own age); ``Rollout.problems`` the taken groups' problems;
    ``Rollout.info`` adds ``rollout/restarted_rows`` and ``rollout/in_flight_groups`` (this rank's). The rows
    still growing stay in ``pool`` for the next steps. Collective over the model replica
    (:class:`alignment.trainers.rl_phases.ReplicaGeneration`); with rollout ranks of their own the pool is theirs
    (:class:`alignment.rollout.engines.carried_remote.RemotePool`: collective over the trainers and them), and its
    rows keep growing while the trainers train."""
    t, hooks, g = time.perf_counter(), step_hooks(cfg), cfg.rollout.group_size
    with rollout_phase(models):
        taken, base = pool.step(ReplicaGeneration(cast(RolloutEngine, models.engine)), version, groups,
                                models.tokenizer)
    problems = [group.item for group in taken]
    samples = [s for group in taken for s in group.samples]
    terms = job_terms(cfg)
    scores = score_terms(models, [p for p in problems for _ in range(g)], samples, terms, cfg)
    rewards = combine(scores, terms, len(samples))  # whitened terms: over the global batch (collective)
    steps = hooks.dense(models, samples) if hooks.dense is not None else None  # the dense term
    info = {"rounds": 1.0, "filled_groups": 0.0, **pool.pop_counts()}
    return Rollout(samples, rewards, base, info=info, seconds=time.perf_counter() - t, reward_terms=scores,
                   steps=steps, problems=problems)


def token_advantages(advantages: torch.Tensor, steps: StepRewards, samples: list[Sample], group_size: int, width: int,
                     normalize_by_std: bool) -> torch.Tensor:
    """``[N, width]`` per-response-token advantages (``width`` >= the longest response: the same on
    every rank, for :func:`balance_over_dp`): the outcome advantages ``[N]`` on every token of each
    response, plus the process reward's weight times its process-supervised advantages
    (:func:`alignment.algorithms.process_rewards.process_advantages`; ``normalize_by_std``: GRPO's,
    False for Dr.GRPO's ``grpo_no_std``)."""
    lengths = [len(s.response_ids) for s in samples]
    out = advantages[:, None] * (torch.arange(width)[None, :] < torch.tensor(lengths)[:, None])
    process = process_advantages(steps.rewards, steps.positions, lengths, group_size, normalize_by_std)
    out[:, : process.shape[1]] += steps.weight * process
    return out


def sample_advantages(rollout: Rollout, cfg: JobConfig) -> torch.Tensor:
    """``[N]`` advantages of this DP rank's samples: ``algorithm.advantage_estimator`` on their rewards
    (batch-whitened estimators over the global batch: collective over DP)."""
    r, a, rewards = cfg.rollout, cfg.algorithm, rollout.rewards
    whitening = {}
    if a.advantage_estimator in BATCH_WHITENED:  # mean and std of the global batch (sequences or tokens)
        dp_group = _ps().get_data_parallel_group()
        whitening = {"all_reduce": lambda sums: all_reduce_sum(sums, dp_group),
                     "token_counts": (torch.tensor([len(s.response_ids) for s in rollout.samples])
                                      if a.whiten_level == "token" else None)}
    return cast(torch.Tensor, get_advantage_estimator(a.advantage_estimator)(rewards, r.group_size, **whitening))


def train(models: Models, rollout: Rollout, cfg: JobConfig, advantages: torch.Tensor | None = None,
          score: Callable[..., None] | None = None, terms: StepTerms | None = None,
          ) -> tuple[dict[str, float], dict[str, float]]:
    """The trainer step on this DP rank's ``rollout``: advantages (``advantages``, ``[N]``, one per sample;
    None: :func:`sample_advantages`), reference (and, for several updates, old) logprobs, then
    :func:`train_step`. An algorithm built on the step gives ``score(batch, packing=, share_prompts=)``, which
    adds its own columns to the batch before the logprob passes (distillation: the teacher's scores), and its
    ``terms`` (:class:`StepTerms`). Returns (global metrics, phase seconds)."""
    ps = _ps()
    r, a, times, hooks = cfg.rollout, cfg.algorithm, {}, step_hooks(cfg)
    samples, rewards, info = rollout.samples, rollout.rewards, rollout.info

    t = time.perf_counter()
    if advantages is None:
        advantages = sample_advantages(rollout, cfg)
    if rollout.steps is not None:  # process supervision: per-token advantages [N, R] (response tokens)
        advantages = token_advantages(advantages, rollout.steps, samples, r.group_size, r.max_tokens,
                                      a.advantage_estimator == "grpo")
    if cfg.trainer.balance_batch:  # after the group statistics: groups may now be split over ranks
        samples, (rewards, advantages) = balance_over_dp(samples, [rewards, advantages])
    batch = make_batch(samples, pad_id=models.tokenizer.pad_token_id or 0)
    if advantages.dim() == 2:  # response tokens -> the batch's columns
        advantages = to_batch_columns(advantages, [len(s.prompt_ids) for s in samples], batch["input_ids"].shape[1])
    batch["advantages"] = advantages
    packing: PassLayout = dict(packing=cfg.trainer.sequence_packing, share_prompts=shares_prompts(cfg))
    zeros = torch.zeros_like(batch["response_mask"])
    if score is not None:  # the algorithm's own columns (distillation: the teacher's scores of the tokens)
        score(batch, **packing)
    if models.reference is not None and a.kl_coef > 0:
        models.placement.keep("reference")
        ref = policy_logprobs(models.reference, microbatches(batch, cfg.trainer), models.vocab_size, r.temperature, **packing)
        batch["ref_logprobs"] = ref if ref is not None else zeros
    if a.ppo_epochs > 1 or a.num_mini_batches > 1:  # several updates: freeze the sampling policy's logprobs
        models.placement.keep("policy")
        # MoE (alignment/training/routing_replay.py): this pass replays the rollout's experts (R3, recorded by
        # the engine); otherwise it records its own, which every update replays (R2) or compares with
        # (moe/routing_agreement)
        routes = hooks.routes.before_updates(models.policy, batch)
        old = policy_logprobs(models.policy, microbatches(batch, cfg.trainer), models.vocab_size, r.temperature,
                              routing=routes, **packing)
        batch["old_logprobs"] = old if old is not None else zeros
        if routes is not None and routes.action == RECORD:
            batch["routed_experts"] = routes.recorded_rows()
    times["logprobs"] = time.perf_counter() - t

    t = time.perf_counter()
    models.placement.keep(*trainable("policy"))
    metrics = train_step(models, batch, cfg, terms)
    times["train"] = time.perf_counter() - t

    # Reward and length statistics over the global batch (one contribution per DP rank).

    dp_leader = replica_group().rank() == 0
    n, s1, s2, length, tokens, model_tokens, rounds, filled = all_reduce_sum([
        float(len(samples)) if dp_leader else 0.0,
        rewards.sum().item() if dp_leader else 0.0,
        (rewards ** 2).sum().item() if dp_leader else 0.0,
        batch["response_lengths"].sum().item() if dp_leader else 0.0,
        float(sum(len(s.prompt_ids) + len(s.response_ids) for s in samples)) if dp_leader else 0.0,
        float(_model_tokens(batch, cfg)) if dp_leader else 0.0,
        info["rounds"] if dp_leader else 0.0, info["filled_groups"] if dp_leader else 0.0])
    mean = s1 / n
    metrics.update({"reward/mean": mean, "reward/std": max(s2 / n - mean * mean, 0.0) ** 0.5,
                    "response_length": length / n, "tokens": tokens, "seq_length": tokens / n,
                    "model_tokens": model_tokens}, **term_metrics(rollout.reward_terms, dp_leader),
                   **step_metrics(rollout.steps, dp_leader))
    if hooks.episodes:
        metrics.update(episode_metrics(samples, dp_leader))
    metrics.update({k: info[k] for k in AGENT_COUNTS if k in info})
    if hooks.keep_group is not None:  # dynamic sampling
        dp = ps.get_data_parallel_world_size()
        metrics.update({"dynamic_sampling/rounds": rounds / dp, "dynamic_sampling/filled_groups": filled})
    return metrics, times
