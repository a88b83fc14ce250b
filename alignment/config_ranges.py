"""The range of every numeric config field, checked first by :func:`alignment.config.validate`, so an
out-of-range number is named with its range before anything uses it (a zero micro-batch size would
otherwise surface as a division by zero). :func:`numeric_fields` walks the schema, and a test keeps
every numeric field in :data:`RANGES` or :data:`UNBOUNDED`.
"""

from __future__ import annotations

import dataclasses
import math
import typing

#: field -> (low, low included, high, high included, what the value means); None: unbounded
RANGES: dict[str, tuple] = {
    "seed": (0, True, None, False, ""),
    "model.moe_aux_loss_coeff": (0, True, None, False, " (0: no load-balancing loss; null: the HF config's)"),
    "model.lora.rank": (0, True, None, False, " (0: no LoRA)"),
    "model.lora.alpha": (0, False, None, False, ""),
    "model.lora.dropout": (0, True, 1, False, ""),
    "parallel.tensor_model_parallel_size": (1, True, None, False, ""),
    "parallel.pipeline_model_parallel_size": (1, True, None, False, ""),
    "parallel.context_parallel_size": (1, True, None, False, ""),
    "parallel.expert_model_parallel_size": (1, True, None, False, ""),
    "parallel.expert_tensor_parallel_size": (1, True, None, False, " (null: tensor_model_parallel_size)"),
    "data.max_length": (2, True, None, False, " (tokens)"),
    "data.max_prompt_length": (1, True, None, False, " (tokens)"),
    "data.train_size": (1, True, None, False, ""),
    "data.heldout_size": (1, True, None, False, ""),
    "data.heldout_fraction": (0, True, 1, False, " (0: no held-out split by hash)"),
    "reward.timeout_s": (0, False, None, False, " (seconds)"),
    "rollout.prompts_per_step": (1, True, None, False, ""),
    "rollout.group_size": (1, True, None, False, ""),
    "rollout.temperature": (0, True, None, False, ""),
    "rollout.top_p": (0, False, 1, True, ""),
    "rollout.max_tokens": (1, True, None, False, " (tokens)"),
    "rollout.eval_max_tokens": (1, True, None, False, " (tokens)"),
    "rollout.eval_pass_k": (0, True, None, False, " (0: no sampled held-out evaluation)"),
    "rollout.max_model_len": (2, True, None, False, " (tokens)"),
    "rollout.kv_cache_gib": (0, False, None, False, " (GiB)"),
    "rollout.gpu_memory_utilization": (0, False, 1, True, " (a fraction of GPU memory)"),
    "rollout.tensor_parallel_size": (1, True, None, False, ""),
    "rollout.sync_bucket_mb": (1, True, None, False, " (MB)"),
    "rollout.max_staleness": (0, True, None, False, " (0: on-policy, 1: one-step off-policy)"),
    "rollout.rollout_ranks": (0, True, None, False, ""),
    "rollout.max_turns": (1, True, None, False, ""),
    "rollout.max_tokens_per_turn": (1, True, None, False, " (null: what is left of rollout.max_tokens)"),
    "algorithm.clip_ratio": (0, False, None, False, ""),
    "algorithm.clip_ratio_high": (0, False, None, False, " (null: clip_ratio)"),
    "algorithm.clip_ratio_c": (1, False, None, False, " (the dual clip, with algorithm.policy_loss=ppo; null: off)"),
    "algorithm.rollout_correction.is_threshold": (0, False, None, False, ""),
    "algorithm.rollout_correction.mask_low": (0, False, None, False, ""),
    "algorithm.rollout_correction.mask_high": (0, False, None, False, ""),
    "algorithm.kl_coef": (0, True, None, False, ""),
    "algorithm.beta": (0, False, None, False, ""),
    "algorithm.label_smoothing": (0, True, 0.5, False, ""),
    "algorithm.simpo_gamma": (0, True, None, False, ""),
    "algorithm.orpo_lambda": (0, True, None, False, ""),
    "algorithm.center_coef": (0, True, None, False, ""),
    "algorithm.gamma": (0, True, 1, True, ""),
    "algorithm.gae_lambda": (0, True, 1, True, ""),
    "algorithm.value_clip": (0, True, None, False, ""),
    "algorithm.target_kl": (0, False, None, False, " (null: no early stop)"),
    "algorithm.ppo_epochs": (1, True, None, False, ""),
    "algorithm.num_mini_batches": (1, True, None, False, ""),
    "algorithm.max_sampling_rounds": (1, True, None, False, ""),
    "algorithm.overlong_buffer_len": (0, True, None, False, " (tokens; 0: no overlong penalty)"),
    "algorithm.overlong_penalty_factor": (0, True, None, False, ""),
    "algorithm.iteration_steps": (1, True, None, False, ""),
    "trainer.steps": (0, True, None, False, " (0: whole epochs)"),
    "trainer.epochs": (1, True, None, False, ""),
    "trainer.global_batch_size": (1, True, None, False, ""),
    "trainer.micro_batch_size": (1, True, None, False, ""),
    "trainer.lr": (0, False, None, False, ""),
    "trainer.weight_decay": (0, True, None, False, ""),
    "trainer.clip_grad": (0, True, None, False, " (0: no clipping)"),
    "trainer.eval_every": (0, True, None, False, " (0: before and after training only)"),
    "trainer.rollout_table_every": (0, True, None, False, " (0: never)"),
    "trainer.max_bad_steps": (0, True, None, False, " (0: never stop)"),
    "trainer.grad_stats_every": (0, True, None, False, " (0: never)"),
    "trainer.save_every": (0, True, None, False, " (0: at the end only)"),
    "trainer.critic_lr": (0, False, None, False, ""),
    "trainer.max_tokens_per_microbatch": (0, True, None, False, " (0: micro_batch_size rows)"),
    "cluster.nodes": (1, True, None, False, ""),
    "cluster.gpus_per_node": (0, True, None, False, " (0: not checked)"),
    "cluster.preempt_signal_seconds": (0, True, None, False, ""),
}
#: numeric fields any value of suits (a reward threshold, bounds on metrics) or that are lists
#: checked where they are used
UNBOUNDED = ("algorithm.accept_threshold", "reward.functions.weight", "reward.functions.batch_size",
             "reward.functions.timeout_s", "reward.functions.max_retries", "trainer.warn_on.below",
             "trainer.warn_on.above", "trainer.stop_on.below", "trainer.stop_on.above", "profile.steps",
             "profile.ranks")


def numeric_fields(cls, prefix: str = "") -> list[str]:
    """Every int / float field of the dataclass schema ``cls`` (e.g. :class:`alignment.config.JobConfig`),
    dotted, nested dataclasses included."""
    hints, out = typing.get_type_hints(cls), []
    for f in dataclasses.fields(cls):
        args = [a for a in typing.get_args(hints[f.name]) if a is not type(None)] or [hints[f.name]]
        if dataclasses.is_dataclass(args[0]):
            out += numeric_fields(args[0], prefix + f.name + ".")
        elif len(args) == 1 and args[0] in (int, float):
            out.append(prefix + f.name)
    return out


def describe(field: str) -> str:
    """``field``'s range in words, e.g. ``>= 1``, ``in (0, 1]``."""
    low, low_in, high, high_in, _ = RANGES[field]
    if high is None:
        return f"{'>=' if low_in else '>'} {low}"
    return f"in {'[' if low_in else '('}{low}, {high}{']' if high_in else ')'}"


def out_of_range(field: str, value) -> bool:
    """Whether ``value`` (a number; None: unset) is outside ``field``'s range (NaN always is)."""
    if value is None or isinstance(value, bool):
        return False
    if isinstance(value, float) and math.isnan(value):
        return True
    low, low_in, high, high_in, _ = RANGES[field]
    below = value < low if low_in else value <= low
    above = high is not None and (value > high if high_in else value >= high)
    return below or above
