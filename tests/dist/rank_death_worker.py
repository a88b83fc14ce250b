"""torchrun worker: the real GRPO pipeline (e2e_worker's ``run_job``, the even-length reward) in which
ONE rank fails at one point of one step, as when a process is killed or a machine stalls; the
others go on until they notice.

    megalign's launcher: rank_death_worker.py MODEL_DIR OUT_DIR POINT STEP [overrides...] RESULT.json

POINT (STEP: the 0-based loop step; the failing rank is rank 1, which writes ``OUT_DIR/failed_at``,
the wall time, first):
- ``rollout``: SIGKILL inside its engine's generation of step STEP's batch;
- ``collective``: SIGKILL after the backward pass of step STEP, while rank 0 goes on into the
  optimizer step's collectives (the gradient norm's all-reduce) and waits there;
- ``checkpoint``: SIGKILL with its shards of the checkpoint after step STEP written, while rank 0
  waits to publish it;
- ``hang``: SIGSTOP (the process stays, stopped) inside its generation of step STEP;
- ``none``: no failure.

Each rank records the error that ends it (``launchers.phase_log.record_error``), as
``launchers/train.py`` does.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path
from tests.dist.report import exit_now


def main() -> None:
    model_dir, out_dir, point, step, *overrides, result_path = sys.argv[1:]
    step = int(step)
    import torch.distributed as dist

    from alignment.data import tasks
    from alignment.rollout.engines.vllm_engine import VLLMEngine
    from alignment.trainers import grpo
    from alignment.training import checkpoint
    from launchers.phase_log import record_error
    from tests.dist.e2e_worker import run_job

    tasks.score_response = lambda problem, text: float(len(text) % 2 == 0)
    now = {"step": -1}
    real_reseed, real_generate = VLLMEngine.reseed, VLLMEngine._generate
    real_guarded, real_publish = grpo.guarded_step, checkpoint.publish

    def fail(sig: int) -> None:
        (Path(out_dir) / "failed_at").write_text(str(time.time()))
        print(f"rank_death_worker: rank 1 sends itself {signal.Signals(sig).name} in the {point} of step {step}",
              flush=True)
        os.kill(os.getpid(), sig)

    def reseed(self, s):  # the loop reseeds the engine before every step's rollout
        now["step"] = s
        real_reseed(self, s)

    def generate(self, prompts, sampling, on_done=None):
        if point in ("rollout", "hang") and now["step"] == step and dist.get_rank() == 1:
            fail(signal.SIGKILL if point == "rollout" else signal.SIGSTOP)
        return real_generate(self, prompts, sampling, on_done)

    def guarded_step(model, optimizer, group_norms=None):
        if point == "collective" and now["step"] == step and dist.get_rank() == 1:
            fail(signal.SIGKILL)
        return real_guarded(model, optimizer, group_norms)

    def publish(tmp, final):
        if point == "checkpoint" and final.name == f"step_{step + 1}" and dist.get_rank() == 1:
            fail(signal.SIGKILL)
        return real_publish(tmp, final)

    VLLMEngine.reseed, VLLMEngine._generate = reseed, generate
    grpo.guarded_step, checkpoint.publish = guarded_step, publish
    try:
        run_job(model_dir, out_dir, overrides, result_path)
    except Exception as e:
        record_error(e)
        raise


if __name__ == "__main__":
    main()
    exit_now()
