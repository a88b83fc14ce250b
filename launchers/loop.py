"""The loop every job runs, top to bottom: the online jobs (the GRPO family, PPO,
rejection-sampling fine-tuning and online DPO) and the offline ones (SFT, reward model, DPO family,
process reward model), for which ``collect`` takes the step's slice of the dataset:

    baseline -> resume (with trainer.reshard_checkpoint: rewrite the checkpoint for any layout, stop)
    -> evaluate (or defer it) -> for each step:
        collect the batches of steps up to max_staleness ahead (online: sample + reward; offline:
        the step's examples) -> train this step's batch (while rollout ranks of their own sample
        the farthest one; the first step: while the engine runs the deferred evaluation) -> online:
        sync weights -> log (and every trainer.rollout_table_every
        steps the rollout table) -> health check (trainer.max_bad_steps, warn_on, stop_on) ->
        preemption check -> checkpoint
    -> evaluate -> final checkpoint -> HF export -> summary

What differs between jobs comes in a :class:`JobSpec` (its ``collect`` and ``train``, the models
its checkpoints hold and its held-out :class:`alignment.trainers.interfaces.Evaluation`), built by the thin launchers
(:mod:`launchers.train` for the GRPO family, ``rft`` and ``online_dpo``; :mod:`launchers.ppo_job`
for PPO; :mod:`launchers.offline_job` for SFT / RM / DPO / PRM). A job is online when its models
hold a rollout engine. Step ``s`` always trains on the same prompts (:func:`prompts_of_step`) or
examples, so a resumed run neither skips nor repeats any, and its generation samples from a stream
of its own (the engines' ``reseed(s)`` as it starts), so a run killed anywhere and resumed goes on
bit for bit as the uninterrupted one (``tests/test_kill_resume.py``).

Staleness (``rollout.max_staleness`` = k, :class:`RolloutQueue`): before training step ``s`` the
batches of steps ``s .. s + k`` must have been sampled; the missing one(s) are sampled now by the
current policy (version ``s``). With k = 0 each step samples its own batch (on-policy, the
synchronous loop); with k = 1 the batch of step ``s + 1`` is sampled before step ``s`` trains, so
step ``s + 1`` trains a policy one update newer than the one that sampled it (one-step off-policy,
the schedule of verl's and NeMo-RL's one-step-off / async GRPO). The loss then weights each token
by ``pi_old / pi_rollout`` (decoupled PPO, Hilton et al. 2021: the trust region around the
trainer's current policy, the importance weight from the behaviour policy: the engine's logprobs
recorded with each sample; ``algorithm.rollout_correction``). In a colocated job the engine and
the trainer share the ranks, so sampling ahead changes what is trained on, not the wall time.
With rollout ranks of their own (``rollout.placement=disaggregated``) the farthest batch is
posted before step ``s`` trains and collected after it (:class:`RolloutQueue`), so the engines
sample it while the trainers train. Batches sampled ahead are not checkpointed: a resumed run
samples them again (same prompts, by the resumed policy). With partial rollouts carried across steps
(``rollout.partial_carry_over``, ``JobSpec.carried``: :mod:`launchers.carried`) nothing is sampled ahead: step
``s`` admits its prompts into the pool in flight and trains the groups that finished first, every token no more
than k updates old; checkpoints keep the prompts in flight, which a resumed run admits again.
"""

from __future__ import annotations

import json
import time
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from alignment.config import total_steps
from alignment.data.prompt_data import EpochOrder
from alignment.models.families import model_dims
from alignment.rewards.remote import RewardServerError, take_failures
from alignment.data.samples import SamplingConfig
from alignment.trainers.interfaces import Batch, JobSpec
from alignment.trainers.models import Models
from alignment.trainers.rl_phases import post_for_group, sync_weights, token_staleness
from alignment.training.checkpoint import (FULLY_RESHARDABLE, ensure_space, latest_checkpoint, load_models_checkpoint,
                                           prune_checkpoints, save_hf_checkpoint, save_models_checkpoint)
from alignment.training.grad_stats import measured
from alignment.training.health import HealthMonitor
from alignment.training.megatron_step import all_reduce_max, all_reduce_sum
from alignment.training.offload import trainable
from launchers import preemption
from launchers.carried import saved_in_flight
from launchers.common import Run, export_adapters
from launchers.input_checks import DATA_POSITION_FILE, data_position
from launchers.phase_log import record
from launchers.profiling import peak_rss_bytes
from launchers.rollout_table import write_rollout_table
from launchers.teardown import close_job
from launchers.trackers import IDS_FILE, saved_ids
from parallel.memory import checkpoint_bytes
from parallel.state import replica_group


class RolloutQueue:
    """Batches sampled ahead of training, at most ``max_staleness`` steps ahead (see the module
    docstring). ``collect(step, version)`` samples step ``step``'s batch by the policy of
    ``version`` updates; ``first``: the step the run starts at; ``end``: one past the last step.

    ``post(step)``, when given (an engine on rollout ranks of its own: ``rollout.placement=
    disaggregated``), starts the generation of step ``step``'s batch without waiting for it: the
    farthest batch a step needs is then posted by :meth:`pop` and collected by :meth:`complete`
    after the step trained, so the engines sample it while the trainers train (its ``collect``
    receives what was posted). The versions are those of the schedule without ``post``.

    ``reseed(step)``, when given, is called as step ``step``'s generation starts (before its
    ``collect``, or its ``post``): the engines' :meth:`alignment.rollout.base.RolloutEngine.reseed`,
    so that every step samples alike in an uninterrupted and a resumed run.
    """

    def __init__(self, collect: Callable[[int, int], Batch], max_staleness: int, first: int, end: int,
                 post: Callable[[int], None] | None = None, reseed: Callable[[int], None] | None = None):
        self.collect, self.max_staleness, self.end, self.post = collect, max_staleness, end, post
        self.reseed: Callable[[int], None] = reseed or (lambda step: None)
        self.pending: deque[Batch] = deque()
        self.next_step = first
        self.posted: tuple[int, int] | None = None

    def _collect(self, step: int, version: int, posted: bool = False) -> float:
        if not posted:
            self.reseed(step)
        rollout = self.collect(step, version)
        rollout.step = step
        self.pending.append(rollout)
        self.next_step = step + 1
        return rollout.seconds

    def pop(self, step: int, version: int) -> tuple[Any, float]:
        """Step ``step``'s batch, after sampling (by the policy of ``version`` updates) every batch of
        steps ``<= step + max_staleness`` not yet sampled (the last of them only posted, with
        ``post``); returns ``(rollout, seconds spent sampling now)``. The schedule of verl's
        one-step-off-policy trainer for ``max_staleness=1``.

        Raises:
            RuntimeError: ``step`` is not the next step the queue holds (steps must be popped in
                order), or a posted batch was not completed.
        """
        if self.posted is not None:
            raise RuntimeError(f"rollout queue: the batch of step {self.posted[0]} was posted but never completed")
        seconds, last = 0.0, min(step + self.max_staleness, self.end - 1)
        while self.next_step <= last:
            if self.post is not None and self.next_step == last > step:
                self.reseed(last)
                self.post(last)
                self.posted = (last, version)
                break
            seconds += self._collect(self.next_step, version)
        rollout = self.pending.popleft()
        if rollout.step != step:
            raise RuntimeError(f"rollout queue out of order: step {step} got the batch of step {rollout.step}")
        return rollout, seconds

    def complete(self) -> float:
        """Collect the batch :meth:`pop` posted, if any (by the version it was posted with); returns
        the seconds spent waiting for it and rewarding it."""
        if self.posted is None:
            return 0.0
        (step, version), self.posted = self.posted, None
        return self._collect(step, version, posted=True)


def engine_stats(models: Models) -> dict[str, float]:
    """The rollout engines' busy and idle seconds since the last call (rollout ranks of their own:
    :meth:`alignment.rollout.engines.disaggregated.RemoteEngine.pop_stats`); ``{}`` for other engines."""
    pop = getattr(models.engine, "pop_stats", None)
    stats: dict[str, float] = pop() if pop is not None else {}
    return stats


def prompts_of_step(train_set: Sequence[Any], step: int, prompts_per_step: int, dp_rank: int, dp: int) -> list[Any]:
    """This DP rank's share of step ``step``'s ``prompts_per_step`` consecutive items of
    ``train_set``: an :class:`alignment.data.prompt_data.EpochOrder` (epoch after epoch, each in its own
    order), or a list taken again from its start: the same for a step whether or not the run was resumed."""

    return [item_at(train_set, i) for i in indices_of_step(step, prompts_per_step, dp_rank, dp)]


def indices_of_step(step: int, prompts_per_step: int, dp_rank: int, dp: int) -> range:
    """The positions in the prompt stream of this DP rank's share of step ``step`` (:func:`prompts_of_step`)."""
    per_rank = prompts_per_step // dp
    first = step * prompts_per_step + dp_rank * per_rank
    return range(first, first + per_rank)


def item_at(train_set: Sequence[Any], i: int) -> Any:
    """The item at position ``i`` of the prompt stream: ``train_set[i]`` of an
    :class:`alignment.data.prompt_data.EpochOrder`, a list taken again from its start."""
    return train_set[i] if isinstance(train_set, EpochOrder) else train_set[i % len(train_set)]


def reward_server_failures() -> list[str]:
    """Every rank's reward-server errors since the last call (:func:`alignment.rewards.remote.take_failures`),
    the same list on every rank (collective: one all-reduce, and an all-gather when there are some)."""
    import torch.distributed as dist

    mine = take_failures()
    if not all_reduce_sum([float(len(mine))])[0]:
        return []
    gathered: list[list[str]] = [[] for _ in range(dist.get_world_size())]
    dist.all_gather_object(gathered, mine)
    return [f for part in gathered for f in part]


def skipped_groups(samples: list[Any], group_size: int) -> float:
    """Groups of the global batch left out of the update because a reward server failed on them
    (``on_error: skip``; :func:`alignment.trainers.rewarding.drop_failed_groups`); collective."""

    lead = replica_group().rank() == 0
    [n] = all_reduce_sum([sum(bool(s.info.get("reward_skipped")) for s in samples) if lead else 0.0])
    return n / group_size


def reshard_and_exit(job: Run, models: Models, spec: JobSpec, latest: Path, step: int, files: dict[str, str] | None
                     ) -> dict[str, Any]:
    """``trainer.reshard_checkpoint``: write the checkpoint just loaded (``latest``, of ``step``) again
    with the distributed optimizer's state in Megatron's fully_reshardable format (model space:
    loads at any TP / PP / EP / DP), the same config, step and data position; then close the
    engine and the process groups. Collective. Returns ``{"resharded": path, "step": step}``."""
    record("checkpoint", step)
    ids = saved_ids(latest)  # the trackers' runs: the next resume continues them
    files = {**(files or {}), **({IDS_FILE: json.dumps(ids)} if ids else {}),
             **(spec.carried.save(step) if spec.carried is not None else {})}  # the prompts in flight, as loaded
    with job.timers("checkpoint"):
        save_models_checkpoint(latest.parent, step, spec.trained, config=job.resolved_config, files=files or None,
                               sharding=FULLY_RESHARDABLE)
    close_job(job, f"rewrote {latest} (step {step}) so that it resumes at any layout: launch the job at the new "
                   "tensor / pipeline / expert / data-parallel sizes (trainer.reshard_checkpoint=false)", models.engine)
    return {"resharded": str(latest), "step": step}


class Checkpoints:
    """The run's checkpoints (``<output_dir>/checkpoints/step_<n>``): every trained model with its Adam state,
    the resolved config and the data position; atomic, the oldest pruned to ``trainer.keep_last``."""

    def __init__(self, job: Run, models: Models, spec: JobSpec):
        self.job, self.models, self.spec = job, models, spec
        self.dir = job.out / "checkpoints"
        self.units = [unit for name, (_, optimizer) in spec.trained.items()  # resident to load or save them
                      for unit in (trainable(name) if optimizer is not None else (name,))]
        self.position = {DATA_POSITION_FILE: json.dumps(data_position(job.cfg, job.prompts))} \
            if getattr(job.prompts, "fingerprint", None) else None

    def path(self, step: int) -> Path:
        return self.dir / f"step_{step}"

    def load_latest(self) -> tuple[int, Path | None]:
        """With ``trainer.resume``, load the latest checkpoint into every trained model; returns ``(step,
        checkpoint)``, ``(0, None)`` for a fresh start. Collective."""
        latest = latest_checkpoint(self.dir) if self.job.cfg.trainer.resume else None
        if latest is None:
            return 0, None
        self.models.placement.keep(*self.units)
        return load_models_checkpoint(latest, self.spec.trained), latest

    def save(self, step: int) -> None:
        """Save step ``step`` (a full disk stops the run cleanly first). Collective."""
        job, t = self.job, self.job.cfg.trainer
        record("checkpoint", step)
        with job.timers("checkpoint"):
            self.models.placement.keep(*self.units)
            ensure_space(self.dir, self._estimate, f"checkpoint step_{step}")
            files = {**(self.position or {}), **job.tracker_files(),  # tracker run ids: rank 0's, which writes them
                     **(self.spec.carried.save(step) if self.spec.carried is not None else {})}  # prompts in flight
            save_models_checkpoint(self.dir, step, self.spec.trained, config=job.resolved_config, files=files or None)
            if t.keep_last and job.rank == 0:  # the new one is complete: older ones may go
                prune_checkpoints(self.dir, t.keep_last)

    def _estimate(self) -> int:  # the first save's size: every trained model with its Adam state
        lora = self.job.cfg.model.lora
        return len(self.spec.trained) * checkpoint_bytes(model_dims(self.job.hf_config), dtype=self.job.cfg.model.dtype,
                                                         lora_rank=lora.rank, lora_targets=tuple(lora.target_modules))


def rollout_queue(job: Run, models: Models, spec: JobSpec, start_step: int, steps_total: int) -> RolloutQueue:
    """The queue of batches for steps ``start_step .. steps_total - 1``: each step's items (:func:`prompts_of_step`
    or ``spec.items``) collected by ``spec.collect``, up to ``rollout.max_staleness`` steps ahead (online jobs),
    posted early to engines of their own, each engine reseeded for the step it samples."""
    from megatron.core import parallel_state as ps

    cfg, online = job.cfg, models.engine is not None
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()

    def items(s: int) -> list[Any]:
        if spec.items is not None:
            return spec.items(s)
        return prompts_of_step(spec.train_set, s, cfg.rollout.prompts_per_step, dp_rank, dp)

    def post(s: int) -> None:  # engines of their own sample step s while this step trains
        assert spec.request is not None  # posted only when the job gives its request
        post_for_group(models.engine, *spec.request(items(s)))

    def reseed(s: int) -> None:  # every engine that samples this step's answers: the student's and a teacher's
        for engine in (models.engine, models.teacher_engine):
            if engine is not None:
                engine.reseed(s)

    prefetches = spec.request is not None and getattr(models.engine, "prefetch", None) is not None
    ahead = cfg.rollout.max_staleness if online and spec.carried is None else 0  # carried: the pool's own staleness
    return RolloutQueue(lambda s, version: spec.collect(items(s), s, version), ahead, start_step, steps_total,
                        post if prefetches else None, reseed=reseed if online else None)


def start_in_flight(spec: JobSpec, start_step: int, steps_total: int, latest: Path | None) -> None:
    """``rollout.partial_carry_over``: the pool starts at ``start_step``, with the prompts in flight that checkpoint
    ``latest`` kept admitted again (a checkpoint of a run with another ``partial_carry_over`` is refused before
    start: :func:`launchers.input_checks.check_resume`)."""
    if spec.carried is not None:
        spec.carried.start(start_step, steps_total, saved_in_flight(latest) if latest is not None else None)


def stop_on_reward_server_failures(step: int, start_step: int, checkpoints: Checkpoints) -> None:
    """A reward server that failed with ``on_error: stop`` on any rank: save the last step (unless saved) and stop.

    Raises:
        RewardServerError: naming the first failure, the step not trained and the checkpoint saved."""
    failures = reward_server_failures()  # collective
    if not failures:
        return
    saved = step > start_step and not checkpoints.path(step).exists()
    if saved:
        checkpoints.save(step)
    where = f"; {checkpoints.path(step)} saved" if saved else ""
    raise RewardServerError(f"{failures[0]} (step {step + 1} not trained{where}; resume when the server answers "
                            "again, or set its on_error: skip)")


def sync_and_measure(job: Run, models: Models, spec: JobSpec, queue: RolloutQueue, step: int, rollout: Any,
                     rollout_s: float, metrics: dict[str, float], times: dict[str, float]) -> dict[str, float]:
    """An online step's end: the batch posted before this step trained collected (after the sync with partial
    rollouts: the engines take the update mid-batch), the new weights synced into the engines, the step's
    rollout metrics (staleness, epoch, skipped groups, engine busy / idle) added to ``metrics``. Returns the
    step's phase seconds. Collective."""
    cfg = job.cfg
    partial = cfg.rollout.partial and queue.posted is not None
    if not partial:
        rollout_s += queue.complete()
    t1 = time.perf_counter()
    record("weight sync", step + 1)
    models.placement.keep("policy")
    metrics.update(sync_weights(models, cfg.rollout.check_weight_sync), **models.placement.pop_stats())
    times = {"rollout": rollout_s, **times, "weight_sync": time.perf_counter() - t1}
    if partial:
        times["rollout"] += queue.complete()
    metrics.update(engine_stats(models))  # rollout ranks of their own: the engines' busy / idle seconds
    metrics["rollout/staleness"] = float(step - rollout.version)
    if spec.carried is not None:  # each rank's batch has its own oldest token: the same value on every rank
        [metrics["rollout/staleness"]] = all_reduce_max([metrics["rollout/staleness"]])
    buckets = cfg.rollout.max_staleness + 1 if spec.carried is not None else 0  # carried: the ages' histogram
    metrics.update(token_staleness(rollout.samples, step - rollout.version, replica_group().rank() == 0, buckets))
    if spec.carried is not None:
        metrics.update(spec.carried.metrics(rollout.info))
    metrics["data/epoch"] = (step + 1) * cfg.rollout.prompts_per_step / len(spec.train_set)  # passes so far
    metrics["reward/skipped_groups"] = skipped_groups(rollout.samples, cfg.rollout.group_size)
    return times


def step_metrics(spec: JobSpec, metrics: dict[str, float], times: dict[str, float], step_time: float
                 ) -> dict[str, float]:
    """The step's metrics with its throughput, phase times and peak memory added (in ``metrics``); returns them
    named as logged (``spec.log_prefix``)."""
    metrics["tokens_per_s"] = metrics.pop("tokens") / step_time
    metrics.update({f"time/{k}": v for k, v in times.items()}, **{"time/step": step_time})
    metrics["memory/peak_rss_gib"] = peak_rss_bytes() / 2**30  # this rank's, so far
    return {f"{spec.log_prefix}{k}": v for k, v in metrics.items()}


def finish(job: Run, models: Models, spec: JobSpec, checkpoints: Checkpoints, start_step: int, steps_total: int,
           startup_s: float) -> dict[str, Any]:
    """After the last step: the final evaluation, checkpoint and HF export (with LoRA's adapters), then the
    summary written and the job closed. Returns the summary."""
    t = job.cfg.trainer
    record("evaluation", steps_total)
    final_metrics, summary, message = spec.evaluation.final()
    job.log(final_metrics, steps_total)
    job.log_table("heldout", job.out / "heldout" / "final.jsonl", steps_total)
    if t.save_checkpoint and start_step < steps_total:
        checkpoints.save(steps_total)
    if t.export_hf:
        record("export", steps_total)
        models.placement.keep("policy")
        save_hf_checkpoint(models.policy, models.bridge, spec.hf_config or job.hf_config, models.tokenizer,
                           job.out / "hf", assets_from=job.hf_dir)
        if spec.export_adapters:
            export_adapters(job, models.policy, models.bridge)
    summary.update(start_step=start_step, steps=steps_total, world_size=job.world, startup_s=startup_s,
                   history=job.history)
    record("end", steps_total)
    return job.finish(summary, message, models.engine)


def run(job: Run, models: Models, spec: JobSpec) -> dict[str, Any]:
    """Run ``spec`` for its steps from the latest checkpoint (``trainer.resume``); returns the
    summary written to ``<output_dir>/summary.json``. ``job``: the :class:`launchers.common.Run`;
    ``models``: the :class:`alignment.trainers.models.Models` (with an engine: an online job).

    Raises:
        FileNotFoundError, ValueError: a checkpoint to resume that is incomplete or saved with an
            incompatible optimizer layout (:func:`alignment.training.checkpoint.load_megatron_checkpoint`).
    Exits with ``launchers.preemption.PREEMPTED_EXIT_CODE`` after saving when asked to stop.
    """
    cfg, t = job.cfg, job.cfg.trainer
    online = models.engine is not None
    steps_total = spec.steps if spec.steps is not None else total_steps(cfg, len(spec.train_set))
    spec.evaluation.baseline()
    checkpoints = Checkpoints(job, models, spec)
    start_step, latest = checkpoints.load_latest()  # every trained model (with its Adam state) resumes together
    start_in_flight(spec, start_step, steps_total, latest)  # partial rollouts carried across steps
    if latest is not None:
        if t.reshard_checkpoint:
            return reshard_and_exit(job, models, spec, latest, start_step, checkpoints.position)
        models.placement.keep("policy")
        if online:
            sync_weights(models, cfg.rollout.check_weight_sync)
        if job.rank == 0:
            print(f"resumed from {latest} (step {start_step})", flush=True)
    job.start_trackers(latest)  # the runs the checkpoint names (launchers/trackers.py)
    if t.eval_before:
        record("evaluation", start_step)
        job.log(spec.evaluation.before(start_step), start_step)
        job.log_table("heldout", job.out / "heldout" / f"step_{start_step}.jsonl", start_step)
        engine_stats(models)  # the evaluation's generation: not a step's
    startup_s = job.seconds_since_launch()
    queue = rollout_queue(job, models, spec, start_step, steps_total)
    health = HealthMonitor(t, job.rank)  # NaN/inf updates, trainer.warn_on / stop_on
    steps = job.progress(start_step, steps_total, spec.name)
    for step in steps:  # the policy has had `step` updates
        t0 = time.perf_counter()
        job.profiler.begin(step)
        record("rollout" if online else "batch", step + 1)
        rollout, rollout_s = queue.pop(step, version=step)
        if online:  # reward.functions: http with on_error=stop
            stop_on_reward_server_failures(step, start_step, checkpoints)
        record("training", step + 1)
        beside = spec.evaluation.beside_first_step() if step == start_step and t.eval_before else None
        with measured(bool(t.grad_stats_every) and (step + 1) % t.grad_stats_every == 0) as grad_norms:
            metrics, times = spec.train(rollout)  # the policy's gradient norms per layer group, on the steps asked
        if beside is not None:  # the base model's held-out accuracy, measured on the engine meanwhile
            job.log(beside(), start_step)
            job.log_table("heldout", job.out / "heldout" / f"step_{start_step}.jsonl", start_step)
        metrics.update(grad_norms)
        times = sync_and_measure(job, models, spec, queue, step, rollout, rollout_s, metrics, times) if online \
            else {"batch": rollout_s, **times}
        job.profiler.end(step)
        step_time = time.perf_counter() - t0
        logged = step_metrics(spec, metrics, times, step_time)
        if t.eval_every and (step + 1) % t.eval_every == 0 and step + 1 < steps_total:
            record("evaluation", step + 1)
            held_out = spec.evaluation.measure(step + 1)
            job.log_table("heldout", job.out / "heldout" / f"step_{step + 1}.jsonl", step + 1)
            engine_stats(models)  # the evaluation's generation: not the next step's
            metrics.update(held_out)
            logged.update(held_out)
        stop = health.check(step + 1, metrics)
        job.log(logged, step + 1)
        job.history.append(metrics)
        if stop:
            checkpoints.save(step + 1)
            raise health.error(str(checkpoints.path(step + 1)))
        if online and t.rollout_table_every and (step + 1) % t.rollout_table_every == 0 and job.rank == 0:
            job.log_table("rollouts", write_rollout_table(job.out, step + 1, rollout, models.tokenizer, job.writer),
                          step + 1)
        if preemption.stop_requested():  # SIGUSR1/SIGTERM on any rank: save this step, exit 75
            preemption.save_and_exit(job, step + 1, checkpoints.save, models.engine)
        if t.save_every and (step + 1) % t.save_every == 0 and step + 1 < steps_total:
            checkpoints.save(step + 1)
        postfix = getattr(steps, "set_postfix", None)  # tqdm's bar on rank 0
        if postfix is not None:
            postfix(**{k: f"{metrics[m]:{f}}" for k, (m, f) in spec.postfix.items() if m in metrics},
                    s=f"{step_time:.1f}")
    return finish(job, models, spec, checkpoints, start_step, steps_total, startup_s)
