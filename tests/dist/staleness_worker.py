"""torchrun worker: the real GRPO pipeline (launchers/train.py's ``run``) with its trainer step
watched, and optionally SIGKILLed.

    torchrun --nproc-per-node 2 tests/dist/staleness_worker.py MODEL_DIR OUT_DIR RECORD_DIR KILL_AT \
        [overrides...] RESULT.json

Reward: 1 if the response text has an even number of characters (a tiny random model never
solves arithmetic; see e2e_worker.py). Before every trainer step this worker records, in
``RECORD_DIR/rank<r>.jsonl``: the step, the policy version that sampled its batch, the problems
it holds (questions), the per-token staleness range, the answers whose tokens span a weight update
(partial rollouts) and the token_mult_prob_error of the batch's own policy's tokens, and the token-level
TIS weight computed by hand from the trainer's current
(proximal) logprobs and the logprobs the rollout engine returned with each sample
(``min(exp(old - behaviour), is_threshold)``, mean over the global batch's tokens), next to the
metrics the real step returned. With ``KILL_AT`` = s >= 0 every rank SIGKILLs itself when step s
is about to train (its batch sampled, nothing of it trained or saved).
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path
from tests.dist.report import exit_now


def main() -> None:
    model_dir, out_dir, record_dir, kill_at, *overrides, result_path = sys.argv[1:]
    import torch
    import torch.distributed as dist

    from alignment.trainers import grpo
    from alignment.trainers.rl_phases import microbatches, policy_logprobs
    from alignment.training.batching import make_batch
    from alignment.training.megatron_step import all_reduce_sum
    from tests.dist.e2e_worker import run_job

    from alignment.data import tasks

    tasks.score_response = lambda problem, text: float(len(text) % 2 == 0)
    real_collect, real_train = grpo.collect, grpo.train

    def collect(models, problems, cfg, refill=None, version=0, **kwargs):
        rollout = real_collect(models, problems, cfg, refill, version, **kwargs)
        # what this batch was sampled for (carried partial rollouts: the groups that finished, of any step's prompts)
        rollout.questions = [p.question for p in (rollout.problems or problems)]
        return rollout

    def train(models, rollout, cfg):
        rank = dist.get_rank()
        if rollout.step == int(kill_at):
            Path(record_dir, f"rank{rank}.killed").write_text(str(rollout.step))
            # the rank and its helper processes (torchrun gives each rank a session of its own), as
            # when a node dies; os.kill of this process alone would leave vLLM's helpers running
            os.killpg(os.getpgid(0), signal.SIGKILL)
        batch = make_batch(rollout.samples, pad_id=0)
        mask = batch["response_mask"]
        old = policy_logprobs(models.policy, microbatches(batch, cfg.trainer), models.vocab_size, cfg.rollout.temperature)
        behaviour = torch.zeros_like(old)  # the engine's own logprobs, straight from its samples
        for i, s in enumerate(rollout.samples):
            start = len(s.prompt_ids) - 1  # row i predicts response token j at position start + j
            behaviour[i, start : start + len(s.logprobs)] = torch.tensor(s.logprobs, dtype=old.dtype)
        threshold = cfg.algorithm.rollout_correction.is_threshold
        weights = torch.exp(old - behaviour).clamp(max=threshold) * mask
        weight_sum, tokens = all_reduce_sum([weights.sum().item(), mask.sum().item()])
        # per token: the policy's age when it sampled the token (partial rollouts: younger after an update)
        ages = [rollout.step - rollout.version - u for s in rollout.samples
                for u in (s.weight_updates or [0] * len(s.response_ids))]
        stale = torch.zeros_like(mask)  # the tokens of the batch's own (older) policy
        for i, s in enumerate(rollout.samples):
            start = len(s.prompt_ids) - 1
            stale[i, start : start + len(s.response_ids)] = torch.tensor(
                [float(u == 0) for u in (s.weight_updates or [0] * len(s.response_ids))])
        stale_error = (torch.exp((old - behaviour).abs()) * stale).sum().item() / max(stale.sum().item(), 1.0)
        metrics, times = real_train(models, rollout, cfg)
        record = {"step": rollout.step, "version": rollout.version, "questions": rollout.questions,
                  "hand_is_weight_mean": weight_sum / tokens, "token_staleness": [min(ages), max(ages)],
                  "spanning_answers": sum(len(set(s.weight_updates or [0])) > 1 for s in rollout.samples),
                  "stale_prob_error": stale_error, **metrics}
        with open(Path(record_dir, f"rank{rank}.jsonl"), "a") as f:
            f.write(json.dumps(record) + "\n")
        return metrics, times

    grpo.collect, grpo.train = collect, train
    run_job(model_dir, out_dir, overrides, result_path)


if __name__ == "__main__":
    main()
    exit_now()
