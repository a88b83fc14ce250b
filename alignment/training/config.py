"""``trainer``: optimisation, evaluation, checkpointing and health settings (:class:`TrainerConfig`,
with :class:`MetricBound` for ``warn_on`` / ``stop_on``), and the checks of their own values
(:func:`check_metric_bounds`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from alignment.schema import ConfigError, plain, ranged, unbounded


@dataclass
class MetricBound:
    """One entry of ``trainer.warn_on`` / ``trainer.stop_on``: a logged metric (its name without the
    ``train/`` prefix of offline jobs, e.g. ``entropy``, ``kl``, ``loss``) and the bounds it must stay
    within (``below``: crossed when the metric falls below it; ``above``: when it rises above)."""

    metric: str = ""
    below: Optional[float] = unbounded(None)
    above: Optional[float] = unbounded(None)


@dataclass
class TrainerConfig:
    """Optimisation (Adam ``lr``, ``micro_batch_size`` sequences per forward), evaluation and checkpointing."""

    # RL: optimizer steps (0: `epochs` passes over the prompts); SFT/RM/DPO: 0 = run `epochs` epochs, else at most
    # this many. Shipped jobs set their task's (the arithmetic demo: 12); a job on your own data takes 0 unless set
    steps: int = ranged(0, 0, note=' (0: whole epochs)', task=True)
    epochs: int = ranged(1, 1)  # passes over the training split (RL: with steps=0)
    global_batch_size: int = ranged(32, 1)  # SFT/RM/DPO: examples (pairs) per optimizer step, over all DP ranks
    micro_batch_size: int = ranged(8, 1)  # RL: sequences per forward; SFT/RM/DPO: examples (pairs) per forward
    # Adam's learning rate (the jobs' YAML sets their own: see the jobs column)
    lr: float = ranged(1e-6, 0, low_in=False)
    weight_decay: float = ranged(0.0, 0)  # AdamW's decoupled weight decay
    clip_grad: float = ranged(1.0, 0, note=' (0: no clipping)')  # the global gradient-norm clip; 0: off
    # 0: evaluate before and after training only
    eval_every: int = ranged(0, 0, note=' (0: before and after training only)')
    # every N steps rank 0 writes its share of the step's rollouts (prompt, conversation, turns,
    # tool calls, rewards) to <output_dir>/rollouts/step_<N>.jsonl and a few rows to TensorBoard; 0: never
    rollout_table_every: int = ranged(0, 0, note=' (0: never)')
    # an update with NaN/inf gradients is skipped (health/skipped_updates); this many consecutive steps
    # with a skipped update stop the run with a checkpoint (alignment/training/health.py); 0: never stop
    max_bad_steps: int = ranged(3, 0, note=' (0: never stop)')
    # every N steps log the gradient norm of each layer group (grad_norm/embedding, grad_norm/layer_07/mlp,
    # ...; alignment/training/grad_stats.py) of the step's first update; 0: never
    grad_stats_every: int = ranged(0, 0, note=' (0: never)')
    # bounds on logged metrics, checked after every step: warn_on prints a warning (health/warnings
    # counts them), stop_on saves a checkpoint and stops the run, e.g. entropy collapse and runaway KL:
    # [{metric: entropy, below: 0.05}, {metric: kl, above: 1.0}]
    warn_on: list[MetricBound] = field(default_factory=list)
    stop_on: list[MetricBound] = field(default_factory=list)  # metric bounds that stop the run (checkpoint first)
    eval_before: bool = True  # evaluate the held-out split before the first step (false: start training at once)
    # RL jobs: reuse the base checkpoint's before-training accuracy from an earlier run with the same
    # weights, prompts and generation settings (~/.cache/megalign/heldout; alignment/trainers/eval_cache.py)
    eval_cache: bool = True
    # RL jobs: a base-model accuracy not in the cache is measured on the rollout engine while the first step
    # trains (the first step starts at once), where the engine can (alignment/trainers/heldout.py); false:
    # before the first step
    eval_before_overlap: bool = True
    # RL jobs: write each greedy held-out evaluation's graded answers (question, reference answer, response,
    # right) to <output_dir>/heldout/step_<N>.jsonl (final.jsonl after training); the accuracy is then not cached
    save_heldout_answers: bool = False
    save_checkpoint: bool = True  # write checkpoints (the final one, and every save_every steps)
    # also checkpoint every N steps (model + optimizer + step); 0: final only
    save_every: int = ranged(0, 0, note=' (0: at the end only)')
    # keep the newest N complete checkpoints, deleting older ones once a newer one is complete (the disk
    # stays bounded on a long run); 0: keep every one
    keep_last: int = ranged(0, 0, note=' (0: keep every checkpoint)')
    # seconds a collective may wait for the other ranks (torch.distributed's and Megatron's process
    # group timeout): a rank that stops answering ends the job then, named (launchers/phase_log.py)
    collective_timeout_s: float = ranged(1800.0, 0, low_in=False, note=' (seconds)')
    resume: bool = True  # continue from the latest complete checkpoint in <output_dir>/checkpoints
    # rewrite the checkpoint this run resumes from so that it resumes at ANY layout (another TP / PP / EP,
    # not only another DP), Adam state, step and data position kept, then stop without training: run once
    # at the layout it was saved with, then launch at the new one (Megatron's fully_reshardable format)
    reshard_checkpoint: bool = False
    use_distributed_optimizer: bool = False  # shard Adam state over data-parallel ranks
    critic_lr: float = ranged(1e-5, 0, low_in=False)  # ppo: the critic's Adam learning rate
    # RL jobs: between phases, move idle models' weights, gradient buffers and Adam state to host
    # memory (verl's param/grad/optimizer_offload). GPU only: a no-op on CPU, where host = device.
    offload: bool = False
    export_hf: bool = True  # at the end, export the trained model as an HF directory <output_dir>/hf
    progress_bar: bool = True  # a tqdm bar on rank 0
    # third-party output (vLLM/transformers logs, library warnings, C++ notices) to
    # <output_dir>/logs/rank<r>.log instead of the console (launchers/console.py)
    quiet: bool = True
    # The model sees each micro-batch's sequences packed end to end (thd + cu_seqlens), no padding
    # between them (verl's use_remove_padding, NeMo-RL's sequence_packing). On by default: the
    # main job's training phase is 24 % faster packed (docs/results.md).
    sequence_packing: bool = True
    # RL jobs: the rows of a micro-batch that share a prompt (a GRPO group) run as ONE packed prompt
    # tree, the prompt computed once (parallel/prompt_tree.py): the same logprobs and gradients as
    # sequence_packing, with 72 % fewer tokens on the main job (4,116 -> 1,148 per step). null: on wherever it runs
    # (context_parallel_size=1, sequence_parallel=false); true: required; false: off.
    shared_prompt_packing: Optional[bool] = None
    # > 0: micro-batches by token budget (real tokens), balanced by Karmarkar-Karp, instead of
    # micro_batch_size rows (verl's use_dynamic_bsz + ppo_max_token_len_per_gpu)
    max_tokens_per_microbatch: int = ranged(0, 0, note=' (0: micro_batch_size rows)')
    # re-deal each step's sequences (RL) or examples (SFT/RM/DPO) over data-parallel ranks by token
    # count, Karmarkar-Karp with equal counts (verl's balance_batch)
    balance_batch: bool = False


def check_metric_bounds(t: TrainerConfig) -> None:
    """``trainer.warn_on`` / ``trainer.stop_on``: each entry names a metric and at least one bound.

    Raises:
        ConfigError: naming the entry and an example.
    """
    for kind in ("warn_on", "stop_on"):
        for b in getattr(t, kind):
            if not b.metric or (b.below is None and b.above is None):
                raise ConfigError(f"trainer.{kind} entry {plain(b)}: give a metric and a bound, e.g. "
                                  "{metric: entropy, below: 0.05} or {metric: kl, above: 1.0}")


def shares_prompts(cfg) -> bool:
    """Whether an RL job's passes run as prompt trees (``trainer.shared_prompt_packing``: null is
    on where it runs, i.e. ``context_parallel_size=1`` and ``sequence_parallel=false``)."""
    t, p = cfg.trainer, cfg.parallel
    if t.shared_prompt_packing is not None:
        return bool(t.shared_prompt_packing)
    return p.context_parallel_size == 1 and not p.sequence_parallel
