"""The held-out evaluation of an RL job (GRPO family, RFT, online DPO, PPO on a task): greedy
accuracy before, during and after training, and pass@k / maj@k when ``rollout.eval_pass_k`` > 0."""

from __future__ import annotations

import torch.distributed as dist

from alignment.config import heldout_grader
from alignment.trainers import grpo
from alignment.trainers.eval_cache import cached_accuracy, heldout_key


class HeldoutAccuracy:
    """The RL jobs' :class:`launchers.loop.Evaluation`: greedy accuracy on the held-out problems, graded
    by :func:`alignment.config.heldout_grader` (before training possibly cached from an earlier run:
    ``trainer.eval_cache``). Without held-out problems or a grader it measures nothing."""

    def __init__(self, job, models, heldout):
        self.job, self.models, self.heldout = job, models, list(heldout)
        self.grader = heldout_grader(job.cfg)
        self.acc_before, self.cached, self.sampled_before = None, False, {}
        self.off = not self.heldout or self.grader is None

    def baseline(self) -> None:
        if self.off and self.job.rank == 0:
            why = "no held-out prompts (data.heldout_files or data.heldout_fraction)" if not self.heldout else \
                "no reward function that grades answers"
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
        return grpo.evaluate(self.models, self.heldout, cfg.rollout.eval_max_tokens, self.grader, answers)

    def _sampled(self) -> dict[str, float]:
        """``heldout/pass@1``, ``pass@k`` (and ``tool_call_rate`` in multi-turn episodes) with
        ``rollout.eval_pass_k`` > 0, else {}."""
        r = self.job.cfg.rollout
        if not r.eval_pass_k:
            return {}
        return grpo.pass_at_k(self.models, self.heldout, r.eval_pass_k, r.eval_max_tokens, r.temperature,
                              tool_calls=r.environment != "single_turn", grader=self.grader)

    def before(self, step: int) -> dict[str, float]:
        job = self.job
        if self.off:
            return {}
        if step == 0:  # the base checkpoint: its accuracy may be known from an earlier run
            key = heldout_key(job.hf_dir, self.models.tokenizer, self.heldout, job.cfg, job.world,
                              compiled=getattr(self.models.engine, "compiled", None))
            cache = job.cfg.trainer.eval_cache and not job.cfg.trainer.save_heldout_answers  # answers: evaluate
            self.acc_before, self.cached = cached_accuracy(key, lambda: self._accuracy("step_0"), cache)
        else:
            self.acc_before = self._accuracy(f"step_{step}")
        if job.rank == 0:
            what = f"at step {step} (resumed)" if step else "before training"
            note = " (cached from an earlier run: trainer.eval_cache)" if self.cached else ""
            print(f"held-out accuracy {what}: {self.acc_before:.3f} ({len(self.heldout)} problems){note}", flush=True)
        self.sampled_before = self._sampled()
        if job.rank == 0 and self.sampled_before:
            print("held-out, sampled: " + ", ".join(f"{k[8:]} {v:.3f}" for k, v in self.sampled_before.items()),
                  flush=True)
        return {"heldout/accuracy": self.acc_before, **self.sampled_before}

    def measure(self, step: int) -> dict[str, float]:
        return {} if self.off else {"heldout/accuracy": self._accuracy(f"step_{step}")}

    def final(self) -> tuple[dict[str, float], dict, str]:
        if self.off:
            return {}, {}, "held-out accuracy: not measured"
        after = self._accuracy("final")
        before = f" (before: {self.acc_before:.3f})" if self.acc_before is not None else ""
        summary = {"heldout_accuracy_before": self.acc_before, "heldout_before_cached": self.cached,
                   "heldout_accuracy_after": after, "heldout_size": len(self.heldout)}
        sampled = self._sampled()
        summary.update({f"{k[8:]}_before": v for k, v in self.sampled_before.items()})
        summary.update({f"{k[8:]}_after": v for k, v in sampled.items()})
        message = f"held-out accuracy after training: {after:.3f}{before}" + "".join(
            f", {k[8:]} {v:.3f} (before: {self.sampled_before.get(k, float('nan')):.3f})" for k, v in sampled.items())
        return {"heldout/accuracy": after, **sampled}, summary, message
