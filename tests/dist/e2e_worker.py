"""torchrun worker: the real GRPO pipeline (launchers/train.py's ``run``) on a model dir.

    torchrun --nproc-per-node 2 tests/dist/e2e_worker.py MODEL_DIR OUT_DIR [REWARD] [overrides...] RESULT.json

REWARD ``task`` keeps the task's own grader. REWARD ``even_length`` replaces it by a
deterministic synthetic reward (1 if the response text has an even number of characters): a tiny
random model never solves arithmetic, so with the real grader every reward, advantage
and gradient would be zero and the test could not see learning or weight sync. REWARD
``hint_only`` (rft) grades every answer to a plain prompt 0 and every answer to a prompt with the
answer as a hint 1, so every problem goes through STaR's rationalisation.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path

from alignment.compose import compose_job
from alignment.data import tasks
from alignment.trainers import rft
from launchers.train import run
from tests.dist.report import exit_now

ROOT = Path(__file__).resolve().parents[2]


def run_job(model_dir: str, out_dir: str, overrides: list[str], result_path: str, config: str = "grpo") -> None:
    """Compose ``configs/<config>.yaml`` (fp32, ``model_dir``, ``out_dir``) with ``overrides`` as every entry
    composes a job (:func:`alignment.compose.compose_job`: strict keys, the data's defaults), run the job and,
    on rank 0, write its summary to ``result_path``."""
    composed = compose_job(config, [f"model.path={model_dir}", f"output_dir={out_dir}", "model.dtype=float32",
                                    *overrides])
    summary = run(composed.cfg, composed)
    if os.environ.get("RANK", "0") == "0":
        Path(result_path).write_text(json.dumps(summary, default=float))


@contextlib.contextmanager
def reward_patch(reward: str):
    """The grader for REWARD (this module's docstring) while the block runs, the real one after."""
    saved = tasks.score_response, rft.build_prompt_ids
    if reward == "even_length":  # the correctness reward and the held-out grader alike
        tasks.score_response = lambda problem, text: float(len(text) % 2 == 0)
    elif reward == "hint_only":  # rft: every answer to a plain prompt is wrong, every answer to a hinted one right
        hinted, build = [False], rft.build_prompt_ids

        def build_prompt_ids(tokenizer, problem, style, hint=None):
            hinted[0] = hint is not None
            return build(tokenizer, problem, style, hint)

        rft.build_prompt_ids = build_prompt_ids
        tasks.score_response = lambda problem, text: float(hinted[0])
    elif reward != "task":
        raise ValueError(f"reward {reward!r}: task, even_length or hint_only")
    try:
        yield
    finally:
        tasks.score_response, rft.build_prompt_ids = saved


def main() -> None:
    model_dir, out_dir, reward, *overrides, result_path = sys.argv[1:]
    with reward_patch(reward):
        run_job(model_dir, out_dir, overrides, result_path)


if __name__ == "__main__":
    main()
    exit_now()
