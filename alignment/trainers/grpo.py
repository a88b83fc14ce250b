"""GRPO (DeepSeekMath, Shao et al. 2024) on Megatron-Core with colocated vLLM rollouts,
and its critic-free variants by config: Dr.GRPO (``advantage_estimator=grpo_no_std``,
``loss_agg_mode=seq-mean-token-sum-norm``), DAPO's clip-higher (``clip_ratio_high``),
RLOO (``rloo``) and REINFORCE++ (``reinforce_plus_plus[_baseline]``).

One step, top to bottom:
  1. rollout   — each rank's vLLM engine samples ``group_size`` responses for its prompts
  2. reward    — verifiable reward from the task's grader
  3. advantage — group-normalised rewards (eq. in Sec. 4.1.2)
  4. logprobs  — frozen reference model's logprobs (for the k3 KL term)
  5. train     — clipped surrogate + kl_coef * KL, token-mean over the global batch, one Adam step
  6. sync      — new weights into the running vLLM engines, in memory
Data layout: every data-parallel (DP) rank owns whole prompt groups; ranks of one
model-parallel (TP x PP) group share the same data and split only its generation.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from alignment.algorithms.advantages import get_advantage_estimator
from alignment.algorithms.aggregation import global_normalizer
from alignment.algorithms.grpo_loss import GRPOLossConfig, grpo_loss
from alignment.data.prompts import build_prompt_ids
from alignment.data.tasks import Problem, score_response
from alignment.rollout.base import Sample, SamplingConfig
from alignment.trainers.batching import make_batch, split_microbatches
from alignment.trainers.megatron_step import forward_backward, token_entropy, token_logprobs


@dataclass
class Models:
    """What one rank holds: its policy shard (DDP-wrapped), optimizer, optional reference
    shard, rollout engine, and the bridge + tokenizer to talk to HF-format engines."""

    policy: torch.nn.Module
    optimizer: object
    reference: torch.nn.Module | None
    engine: object
    bridge: object
    tokenizer: object
    vocab_size: int


def _ps():
    from megatron.core import parallel_state as ps

    return ps


def generate_for_group(engine, prompts: list[list[int]], sampling: SamplingConfig) -> list[list[Sample]]:
    """Generate for this DP rank's prompts, splitting the work over the ranks of its
    model-parallel group (each has an engine) and gathering every group's samples."""
    ps = _ps()
    group = ps.get_model_parallel_group()
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    mine = engine.generate(prompts[rank::size], sampling) if prompts[rank::size] else []
    gathered = [None] * size
    dist.all_gather_object(gathered, mine, group=group)
    out = [None] * len(prompts)
    for r, part in enumerate(gathered):
        out[r::size] = part
    return out


def all_reduce_sum(values: list[float], group=None) -> list[float]:
    """Element-wise sum of ``values`` over the ranks of ``group`` (default: all ranks), in
    float64 so that token counts and metric sums stay exact; collective."""
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, group=group)
    return t.tolist()


def policy_logprobs(model, microbatches, vocab_size: int, temperature: float = 1.0) -> torch.Tensor | None:
    """Forward-only logprobs ``[N, seq]`` of ``softmax(logits / temperature)`` (last
    pipeline stage; ``None`` elsewhere)."""

    def collect(mb, logits):
        return logits.sum() * 0, {"logprobs": token_logprobs(logits / temperature, mb["input_ids"], vocab_size)}

    with torch.no_grad():
        out = forward_backward(model, microbatches, collect, forward_only=True)
    return torch.cat([o["logprobs"] for o in out]) if out else None


def train_step(models: Models, batch: dict, cfg) -> dict[str, float]:
    """One optimizer step on this rank's share of the global batch. Returns global metrics."""
    ps = _ps()
    a = cfg.algorithm
    loss_cfg = GRPOLossConfig(clip_ratio=a.clip_ratio, clip_ratio_high=a.clip_ratio_high, kl_coef=a.kl_coef,
                              kl_estimator=a.kl_estimator, loss_agg_mode=a.loss_agg_mode)
    # The normaliser of the loss over the WHOLE global batch (all micro-batches, all DP ranks).
    tokens, seqs = all_reduce_sum([batch["response_mask"].sum().item(), float(batch["input_ids"].shape[0])],
                                  ps.get_data_parallel_group())
    normalizer = global_normalizer(a.loss_agg_mode, tokens, seqs, cfg.rollout.max_tokens)

    def loss_fn(mb, logits):
        # The policy being optimised is the one vLLM samples from: softmax(logits / T).
        logits = logits / cfg.rollout.temperature
        mask = mb["response_mask"]
        entropy_sum = (token_entropy(logits, models.vocab_size) * mask).sum()  # before logprobs consume logits
        lp = token_logprobs(logits, mb["input_ids"], models.vocab_size)
        # One optimizer step per rollout batch: the sampling policy is the current one,
        # so old_logprobs are the current logprobs without gradient (ratio == 1).
        loss, m = grpo_loss(lp, lp.detach(), mb.get("ref_logprobs"), mb["advantages"], mb["response_mask"],
                            normalizer, loss_cfg)
        m["entropy_sum"] = entropy_sum
        with torch.no_grad():
            m["prob_error_sum"] = (torch.exp((lp.detach() - mb["rollout_logprobs"]).abs()) * mask).sum()
        return loss, m

    models.policy.zero_grad_buffer()
    models.optimizer.zero_grad()
    out = forward_backward(models.policy, split_microbatches(batch, cfg.trainer.micro_batch_size), loss_fn,
                           forward_only=False)
    _, grad_norm, _ = models.optimizer.step()
    keys = ["policy_loss_sum", "kl_sum", "clipped_tokens", "entropy_sum", "prob_error_sum", "tokens"]
    local = [sum(o[k].item() for o in out) for k in keys]
    # Only one rank per model-parallel group contributes (the last stage's TP rank 0).
    if not (ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == 0):
        local = [0.0] * len(keys)
    sums = dict(zip(keys, all_reduce_sum(local)))
    n = max(sums.pop("tokens"), 1.0)
    return {
        "loss/policy": sums["policy_loss_sum"] / n,
        "kl": sums["kl_sum"] / n,
        "clip_fraction": sums["clipped_tokens"] / n,
        "entropy": sums["entropy_sum"] / n,
        "token_mult_prob_error": sums["prob_error_sum"] / n,
        "grad_norm": float(grad_norm) if grad_norm is not None else 0.0,
    }


def sync_weights(models: Models) -> None:
    """Policy shards -> full HF tensors -> every rank's running vLLM engine."""
    from alignment.models.weights import export_hf_weights

    models.engine.update_weights(export_hf_weights(models.policy, models.bridge).items())


def evaluate(models: Models, problems: list[Problem], task: str, max_tokens: int) -> float:
    """Greedy held-out accuracy (fraction of reward-1 answers), problems split over all ranks."""
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = problems[rank::world]
    prompts = [build_prompt_ids(models.tokenizer, p.question, task) for p in mine]
    outs = models.engine.generate(prompts, SamplingConfig(n=1, temperature=0.0, max_tokens=max_tokens)) if mine else []
    correct = sum(score_response(p, o[0].text) == 1.0 for p, o in zip(mine, outs))
    return all_reduce_sum([correct])[0] / len(problems)


def grpo_step(models: Models, problems: list[Problem], cfg) -> tuple[dict[str, float], dict[str, float]]:
    """One GRPO step on this DP rank's ``problems``. Returns (metrics, phase seconds)."""
    ps = _ps()
    r, times = cfg.rollout, {}
    t = time.perf_counter()
    prompts = [build_prompt_ids(models.tokenizer, p.question, cfg.data.task) for p in problems]
    groups = generate_for_group(models.engine, prompts, SamplingConfig(
        n=r.group_size, temperature=r.temperature, top_p=r.top_p, max_tokens=r.max_tokens))
    samples = [s for g in groups for s in g]
    rewards = torch.tensor([score_response(p, s.text) for p, g in zip(problems, groups) for s in g])
    times["rollout"] = time.perf_counter() - t

    t = time.perf_counter()
    batch = make_batch(samples, pad_id=models.tokenizer.pad_token_id or 0)
    batch["advantages"] = get_advantage_estimator(cfg.algorithm.advantage_estimator)(rewards, r.group_size)
    if models.reference is not None and cfg.algorithm.kl_coef > 0:
        ref = policy_logprobs(models.reference, split_microbatches(batch, cfg.trainer.micro_batch_size),
                              models.vocab_size, r.temperature)
        batch["ref_logprobs"] = ref if ref is not None else torch.zeros_like(batch["response_mask"])
    times["logprobs"] = time.perf_counter() - t

    t = time.perf_counter()
    metrics = train_step(models, batch, cfg)
    times["train"] = time.perf_counter() - t

    t = time.perf_counter()
    sync_weights(models)
    times["weight_sync"] = time.perf_counter() - t

    # Reward and length statistics over the global batch (one contribution per DP rank).
    dp_leader = ps.get_model_parallel_group().rank() == 0
    n, s1, s2, length, tokens = all_reduce_sum([
        float(len(samples)) if dp_leader else 0.0,
        rewards.sum().item() if dp_leader else 0.0,
        (rewards ** 2).sum().item() if dp_leader else 0.0,
        batch["response_lengths"].sum().item() if dp_leader else 0.0,
        float(sum(len(s.prompt_ids) + len(s.response_ids) for s in samples)) if dp_leader else 0.0])
    mean = s1 / n
    metrics.update({"reward/mean": mean, "reward/std": max(s2 / n - mean * mean, 0.0) ** 0.5,
                    "response_length": length / n, "tokens": tokens})
    return metrics, times
