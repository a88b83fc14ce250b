"""torchrun worker: the real GRPO pipeline (e2e_worker's ``run_job``, the even-length reward) SIGKILLed
at one point of one step, as when a node dies: every rank's whole process group (vLLM's helpers too).

    torchrun --nproc-per-node 2 tests/dist/kill_worker.py MODEL_DIR OUT_DIR POINT STEP [overrides...] RESULT.json

POINT (STEP: the 0-based loop step):
- ``rollout``: rank STEP % 2 inside its engine's generation of step STEP's batch;
- ``training``: every rank after the backward pass of step STEP, before the optimizer step;
- ``sync``: rank 0 in the middle of the weight sync after step STEP (its first bucket loaded);
- ``checkpoint``: rank 0 with the checkpoint after step STEP written on every rank, before it is
  published (renamed from ``step_N.tmp``);
- ``none``: no kill.

Rank 0 appends each step's metrics, as they are logged, to ``OUT_DIR/steps.jsonl`` (full precision;
a killed run's lines stay), so that a chain of killed runs can be compared step by step.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path
from tests.dist.report import exit_now


def _kill(point: str, step: int) -> None:
    print(f"kill_worker: SIGKILL in the {point} of step {step}", flush=True)
    os.killpg(os.getpgid(0), signal.SIGKILL)


def main() -> None:
    model_dir, out_dir, point, step, *overrides, result_path = sys.argv[1:]
    step = int(step)
    import torch.distributed as dist

    from alignment.data import tasks
    from alignment.rollout.engines.vllm_engine import VLLMEngine
    from alignment.trainers import grpo
    from alignment.training import checkpoint
    from launchers.common import Run
    from tests.dist.e2e_worker import run_job

    tasks.score_response = lambda problem, text: float(len(text) % 2 == 0)
    now = {"step": -1, "trained": False}
    real_reseed, real_generate, real_load = VLLMEngine.reseed, VLLMEngine._generate, VLLMEngine.load_resharded
    real_train, real_guarded, real_publish = grpo.train, grpo.guarded_step, checkpoint.publish
    real_log = Run.log

    def log(self, values, s):
        real_log(self, values, s)
        if self.rank == 0 and "time/step" in values:  # a training step's metrics
            with open(Path(out_dir) / "steps.jsonl", "a") as f:
                f.write(json.dumps({"step": s, **{k: float(v) for k, v in values.items()}}) + "\n")

    def reseed(self, s):  # the loop reseeds the engine before every step's rollout
        now["step"], now["trained"] = s, False
        real_reseed(self, s)

    def generate(self, prompts, sampling, on_done=None):
        if point == "rollout" and now["step"] == step and dist.get_rank() == step % 2:
            _kill(point, step)
        return real_generate(self, prompts, sampling, on_done)

    def train(models, rollout, cfg):
        out = real_train(models, rollout, cfg)
        now["trained"] = True
        return out

    def guarded_step(model, optimizer, group_norms=None):
        if point == "training" and now["step"] == step:
            _kill(point, step)
        return real_guarded(model, optimizer, group_norms)

    def load_resharded(self, buckets):
        if point == "sync" and now["step"] == step and now["trained"] and dist.get_rank() == 0:
            def cut():
                for bucket in buckets:
                    yield bucket
                    _kill(point, step)  # the engine asks for the next bucket: half-synced
            return real_load(self, cut())
        return real_load(self, buckets)

    def publish(tmp, final):
        if point == "checkpoint" and final.name == f"step_{step + 1}" and dist.get_rank() == 0:
            dist.barrier()  # every rank has written its shards
            _kill(point, step)
        return real_publish(tmp, final)

    VLLMEngine.reseed, VLLMEngine._generate, VLLMEngine.load_resharded = reseed, generate, load_resharded
    grpo.train, grpo.guarded_step, checkpoint.publish = train, guarded_step, publish
    Run.log = log
    run_job(model_dir, out_dir, overrides, result_path)


if __name__ == "__main__":
    main()
    exit_now()
