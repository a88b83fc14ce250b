"""The held-out evaluation of an RL job (GRPO family, RFT, online DPO, PPO on a task): greedy
accuracy before, during and after training, and pass@k / maj@k when ``rollout.eval_pass_k`` > 0.

The base model's accuracy (before training) is read from the cache when an earlier run measured it
(``trainer.eval_cache``). Otherwise, with ``trainer.eval_before_overlap`` (default), it is measured
beside the first step: the first rollout is sampled first (as without an evaluation, so the run's
samples do not depend on the cache), then the rollout engine, idle until the weight sync, answers
the held-out problems on a thread of its own while the trainer computes the first update, and the
loop logs the accuracy at step 0 once both are done (:meth:`HeldoutAccuracy.beside_first_step`). The
first step starts as soon as the models are built. The engine must hold weights of its own and
generate without any collective: a vLLM engine with ``rollout.tensor_parallel_size=1`` on colocated
ranks, one rank per model replica, single-turn answers, no sampled evaluation; otherwise (and with
``trainer.eval_before_overlap=false``) it is measured before the first step, as peers do (verl's
``val_before_train``, NeMo-RL's ``val_at_start``).

The held-out generation and grading every RL job shares are here too: greedy accuracy (:func:`evaluate`),
sampled pass@k / maj@k (:func:`pass_at_k`), and one rank's counts (:func:`heldout_counts`).
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist

from alignment.algorithms.composite_reward import RewardTerm
from alignment.config import JobConfig
from alignment.data.tasks import Problem
from alignment.rewards import grading
from alignment.rewards.code_runs import early_grading
from alignment.rewards.policy import heldout_grader
from alignment.data.samples import SamplingConfig
from alignment.trainers.agent_rollout import agent_episodes
from alignment.trainers.eval_cache import cacheable, cached_accuracy, heldout_key, lookup_accuracy, store_accuracy
from alignment.trainers.models import Models
from alignment.trainers.rl_phases import generate_episodes, rollout_phase
from alignment.training.megatron_step import all_reduce_sum
from parallel.state import replica_group


class HeldoutJob(Protocol):
    """What :class:`HeldoutAccuracy` reads of the job (a :class:`launchers.common.Run`)."""

    @property
    def cfg(self) -> JobConfig: ...

    @property
    def rank(self) -> int: ...

    @property
    def world(self) -> int: ...

    @property
    def hf_dir(self) -> Path: ...

    @property
    def out(self) -> Path: ...


class HeldoutAccuracy:
    """The RL jobs' :class:`alignment.trainers.interfaces.Evaluation`: greedy accuracy on the held-out problems, graded
    by :func:`alignment.config.heldout_grader` (before training possibly cached from an earlier run:
    ``trainer.eval_cache``). Without held-out problems or a grader it measures nothing."""

    grader: RewardTerm | None
    acc_before: float | None
    cached: bool
    sampled_before: dict[str, float]

    def __init__(self, job: HeldoutJob, models: Models, heldout: Iterable[Problem]) -> None:
        self.job, self.models, self.heldout = job, models, list(heldout)
        self.grader = heldout_grader(job.cfg)  # type: ignore[no-untyped-call]  # alignment.rewards.policy: unannotated
        self.acc_before, self.cached, self.sampled_before = None, False, {}
        self.off = not self.heldout or self.grader is None
        self.deferred: str | None = None  # the cache key of a before-training accuracy measured beside step 1
        self.overlapped = False  # whether it was

    def baseline(self) -> None:
        if self.off and self.job.rank == 0:
            r = self.job.cfg.rollout
            held = ("the environment has no eval dataset" if r.environment == "verifiers" else
                    "rollout.environment_args.heldout_size=0" if r.environment == "openenv" else
                    "data.heldout_files or data.heldout_fraction")
            why = f"no held-out prompts ({held})" if not self.heldout else "no reward function that grades answers"
            print(f"held-out accuracy: not measured, {why}", flush=True)

    def _accuracy(self, when: str) -> float:
        """Greedy accuracy; with ``trainer.save_heldout_answers`` the graded answers go to
        ``<output_dir>/heldout/<when>.jsonl`` (``when``: ``step_<N>`` or ``final``)."""
        cfg = self.job.cfg
        answers = self.job.out / "heldout" / f"{when}.jsonl" if cfg.trainer.save_heldout_answers else None
        if answers is not None:  # a resumed run's evaluation replaces the earlier one's
            if self.job.rank == 0:
                answers.unlink(missing_ok=True)
            dist.barrier()
        return evaluate(self.models, self.heldout, cfg.rollout.eval_max_tokens, self.grader, answers)

    def _sampled(self) -> dict[str, float]:
        """``heldout/pass@1``, ``pass@k`` (and ``tool_call_rate`` in multi-turn episodes) with
        ``rollout.eval_pass_k`` > 0, else {}."""
        r = self.job.cfg.rollout
        if not r.eval_pass_k:
            return {}
        return pass_at_k(self.models, self.heldout, r.eval_pass_k, r.eval_max_tokens, r.temperature,
                              tool_calls=r.environment != "single_turn", grader=self.grader)

    def before(self, step: int) -> dict[str, float]:
        job = self.job
        if self.off:
            return {}
        if step == 0:  # the base checkpoint: its accuracy may be known from an earlier run
            key = heldout_key(job.hf_dir, self.models.tokenizer, self.heldout, job.cfg, job.world,
                              compiled=getattr(self.models.engine, "compiled", None))
            cache = (job.cfg.trainer.eval_cache and not job.cfg.trainer.save_heldout_answers  # answers: evaluate
                     and cacheable(job.cfg))
            if self.overlap_blocker() is not None:
                self.acc_before, self.cached = cached_accuracy(key, lambda: self._accuracy("step_0"), cache)
            elif (found := lookup_accuracy(key, cache)) is not None:
                self.acc_before, self.cached = found, True
            else:
                self.deferred = key
                if job.rank == 0:
                    print(f"held-out accuracy before training: measured beside step 1 ({len(self.heldout)} problems; "
                          "trainer.eval_before_overlap)", flush=True)
                return {}
        else:
            self.acc_before = self._accuracy(f"step_{step}")
        self._report(step)
        self.sampled_before = self._sampled()
        if job.rank == 0 and self.sampled_before:
            print("held-out, sampled: " + ", ".join(f"{k[8:]} {v:.3f}" for k, v in self.sampled_before.items()),
                  flush=True)
        return {"heldout/accuracy": self.acc_before, **self.sampled_before}

    def _report(self, step: int) -> None:
        if self.job.rank == 0:
            what = f"at step {step} (resumed)" if step else "before training"
            note = " (cached from an earlier run: trainer.eval_cache)" if self.cached else \
                " (measured beside step 1)" if self.overlapped else ""
            print(f"held-out accuracy {what}: {self.acc_before:.3f} ({len(self.heldout)} problems){note}", flush=True)

    def overlap_blocker(self) -> str | None:
        """Why the base model's evaluation cannot run beside the first step (see the module
        docstring), or None when it can."""
        cfg, engine = self.job.cfg, self.models.engine
        r = cfg.rollout
        if not cfg.trainer.eval_before_overlap:
            return "trainer.eval_before_overlap=false"
        if engine is None or engine.shares_trainer_weights or engine.generates_per_replica:
            return "the engine runs the trainer's own weights (rollout.backend=megatron)"
        if r.placement != "colocated":
            return "rollout ranks of their own (rollout.placement=disaggregated)"
        if r.tensor_parallel_size != 1:
            return "a TP>1 engine generates collectively (rollout.tensor_parallel_size)"
        if replica_group().size() != 1:
            return "the ranks of a model replica generate together (model parallelism)"
        if self.models.agents is not None or r.environment != "single_turn":
            return "multi-turn episodes take turns together (rollout.environment)"
        if r.eval_pass_k:
            return "the sampled evaluation draws from the engine's stream (rollout.eval_pass_k)"
        return None

    def beside_first_step(self) -> Callable[[], dict[str, float]] | None:
        """With the before-training evaluation deferred (:meth:`before`): start it on a thread of its
        own, on the rollout engine (call it once the first rollout is sampled and before the weight
        sync), and return the function that waits for it (collective: every rank calls it, before the
        weight sync) and returns the metrics to log at step 0; None when nothing was deferred."""
        if self.deferred is None:
            return None
        cfg = self.job.cfg
        answers = self.job.out / "heldout" / "step_0.jsonl" if cfg.trainer.save_heldout_answers else None
        if answers is not None and self.job.rank == 0:
            answers.unlink(missing_ok=True)  # the thread touches no process group: no barrier after
        sampling = SamplingConfig(n=1, temperature=0.0, max_tokens=cfg.rollout.eval_max_tokens)
        result: dict[str, Any] = {}  # "counts", or "error": what the evaluation raised
        device = torch.cuda.current_device() if torch.cuda.is_available() else None

        def evaluate() -> None:
            try:
                if device is not None:  # a new thread starts on GPU 0: this rank's GPU, as the engine's
                    torch.cuda.set_device(device)
                result["counts"] = heldout_counts(self.models, self.heldout, sampling, self.grader, answers)
            except BaseException as e:  # raised again on the loop's thread
                result["error"] = e

        # a daemon: a step that fails does not wait for the evaluation before the process exits
        thread = threading.Thread(target=evaluate, name="heldout-before", daemon=True)
        thread.start()
        key, self.deferred = self.deferred, None

        def finish() -> dict[str, float]:
            thread.join()
            if "error" in result:
                raise result["error"]
            self.acc_before = heldout_rates(result["counts"], 1)["pass@1"]
            store_accuracy(key, self.acc_before, cfg.trainer.eval_cache and not cfg.trainer.save_heldout_answers)
            self.overlapped = True
            self._report(0)
            return {"heldout/accuracy": self.acc_before}

        return finish

    def measure(self, step: int) -> dict[str, float]:
        return {} if self.off else {"heldout/accuracy": self._accuracy(f"step_{step}")}

    def final(self) -> tuple[dict[str, float], dict[str, Any], str]:
        if self.off:
            return {}, {}, "held-out accuracy: not measured"
        after = self._accuracy("final")
        before = f" (before: {self.acc_before:.3f})" if self.acc_before is not None else ""
        summary = {"heldout_accuracy_before": self.acc_before, "heldout_before_cached": self.cached,
                   "heldout_before_overlapped": self.overlapped,
                   "heldout_accuracy_after": after, "heldout_size": len(self.heldout)}
        sampled = self._sampled()
        summary.update({f"{k[8:]}_before": v for k, v in self.sampled_before.items()})
        summary.update({f"{k[8:]}_after": v for k, v in sampled.items()})
        message = f"held-out accuracy after training: {after:.3f}{before}" + "".join(
            f", {k[8:]} {v:.3f} (before: {self.sampled_before.get(k, float('nan')):.3f})" for k, v in sampled.items())
        return {"heldout/accuracy": after, **sampled}, summary, message


def evaluate(models: Models, problems: list[Problem], max_tokens: int, grader: RewardTerm | None = None,
             answers: Path | None = None) -> float:
    """Greedy held-out accuracy (fraction of reward-1 answers): problems dealt over the
    data-parallel ranks, each replica's share run as episodes of ``models.episodes``' environment
    (:func:`alignment.trainers.rl_phases.generate_episodes`; the task's prompt, ``data.instruction``
    included, and one answer for ``rollout.environment=single_turn``), graded as ``tools/evaluate.py``
    grades (:mod:`alignment.rewards.grading`) and counted once (by the replica's first rank).
    ``max_tokens``: the response budget (``rollout.eval_max_tokens``); ``grader``: the reward term whose
    score >= 1 is right (None: ``correctness``; :func:`alignment.config.heldout_grader`); ``answers``: a
    JSONL file each replica's first rank appends its graded answers to (``trainer.save_heldout_answers``:
    one line per problem with its question, reference answer, the response and whether it was right)."""
    sampling = SamplingConfig(n=1, temperature=0.0, max_tokens=max_tokens)
    return _heldout(models, problems, sampling, grader, answers)["pass@1"]


def pass_at_k(models: Models, problems: list[Problem], k: int, max_tokens: int, temperature: float,
              tool_calls: bool = False, grader: RewardTerm | None = None) -> dict[str, float]:
    """Sampled held-out metrics: ``k`` episodes per problem at ``temperature`` (dealt over the
    data-parallel ranks like :func:`evaluate`, graded by :mod:`alignment.rewards.grading`).
    Returns ``heldout/pass@1``, ``heldout/pass@<k>`` (Chen et al. 2021's unbiased estimator) and
    ``heldout/maj@<k>`` (majority vote) for ``k`` > 1, and with ``tool_calls``
    ``heldout/tool_call_rate`` (episodes with a tool call). Collective.

    Raises:
        ValueError: ``k`` < 1.
    """
    if k < 1:
        raise ValueError(f"rollout.eval_pass_k={k}: must be >= 1 (0 turns the sampled evaluation off)")
    out = _heldout(models, problems, SamplingConfig(n=k, temperature=temperature, max_tokens=max_tokens), grader)
    tool_rate = out.pop("tool_call_rate")
    return {f"heldout/{key}": v for key, v in {**out, **({"tool_call_rate": tool_rate} if tool_calls else {})}.items()}


def _heldout(models: Models, problems: list[Problem], sampling: SamplingConfig, grader: RewardTerm | None = None,
             answers: Path | None = None) -> dict[str, float]:
    """:func:`alignment.rewards.grading.rates` of ``sampling.n`` episodes per problem, this DP
    rank's share generated and graded, the counts summed over replicas (one rank each)."""
    return heldout_rates(heldout_counts(models, problems, sampling, grader, answers), sampling.n)


def heldout_counts(models: Models, problems: list[Problem], sampling: SamplingConfig, grader: RewardTerm | None = None,
                   answers: Path | None = None) -> dict[str, float]:
    """This DP rank's share of ``problems`` (every DP-size-th) generated (``sampling.n`` episodes each)
    and graded: :func:`alignment.rewards.grading.counts`, zeros but on the replica's first rank, which
    also appends the graded answers to ``answers``. Collective only where the generation is: over the
    model replica and a TP>1 engine's group, and between turns of multi-turn episodes; with none of
    those it touches no process group (the held-out evaluation run beside the first step,
    :class:`alignment.trainers.heldout.HeldoutAccuracy`)."""
    from megatron.core import parallel_state as ps

    mine = list(problems[ps.get_data_parallel_rank()::ps.get_data_parallel_world_size()])
    grader = grader or grading.CORRECTNESS
    with early_grading([grader.runs], mine) as (pool, on_done):  # code runs start as answers are generated
        with rollout_phase(models):
            groups = (agent_episodes(models, mine, sampling.n, sampling.max_tokens, force=sampling)[0]
                      if models.agents is not None else generate_episodes(models, mine, sampling, on_done))
        correct = grading.grade(mine, groups, sampling.max_tokens, grader, pool)
    counts = grading.counts(mine, groups, correct, sampling.n)
    lead = replica_group().rank() == 0
    if answers is not None and lead:  # one write per replica, appended whole (O_APPEND)
        text = "".join(json.dumps({"question": p.question, "answer": p.answer, "response": s.text, "right": bool(ok)})
                       + "\n" for p, g, right in zip(mine, groups, correct) for s, ok in zip(g, right))
        answers.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(answers, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            os.write(fd, text.encode())
        finally:
            os.close(fd)
    return {k: v if lead else 0.0 for k, v in counts.items()}


def heldout_rates(counts: dict[str, float], n: int) -> dict[str, float]:
    """:func:`alignment.rewards.grading.rates` of every rank's :func:`heldout_counts` summed (collective
    over the default group) for ``n`` episodes per problem."""
    summed = all_reduce_sum(list(counts.values()))
    return grading.rates(dict(zip(counts, summed)), n)
