"""A reasoning-gym task as a verifiers environment, written as an Environments Hub package is (verifiers' classic
API, no megalign import): ``load_environment()`` returns a ``vf.SingleTurnEnv`` whose dataset is the task's
questions and whose rubric is reasoning-gym's own ``score_answer`` of the reply's last number.

Train on it (the main job's task, chain_sum with one-digit terms, through the environment):

    megalign train --nproc 2 rollout.environment=verifiers \\
        rollout.environment_id=examples.environments.reasoning_gym_env \\
        rollout.agent_max_tokens=48 trainer.steps=12

``environment_args`` choose the task: ``{task: basic_arithmetic, task_kwargs: {min_terms: 3}}``. The training and
eval questions are disjoint: a question goes to the eval split when its hash falls in one bucket of ten, as the
built-in task's held-out split does.
"""

from __future__ import annotations

import hashlib
import json
import re

import reasoning_gym
import verifiers as vf
from datasets import Dataset

#: the instruction after each question (the built-in arithmetic task's)
INSTRUCTION = "Answer with a single number."
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def last_number(text: str) -> str | None:
    """The reply's answer: the number in its last ``\\boxed{...}``, else its last number (commas dropped)."""
    boxed = re.findall(r"\\boxed\{([^{}]*)\}", text)
    for candidate in (boxed[-1] if boxed else "", text):
        found = _NUMBER.findall(candidate.replace("\u2212", "-"))
        if found:
            return found[-1].replace(",", "").rstrip(".")
    return None


def _held_out(question: str) -> bool:
    return int.from_bytes(hashlib.sha256(question.encode()).digest()[:8], "little") % 10 == 0


def _split(task, kwargs: dict, seed: int, size: int, eval_split: bool) -> Dataset:
    ds = reasoning_gym.create_dataset(task, size=50 * size + 1000, seed=seed, **kwargs)
    rows = []
    for entry in ds:
        if _held_out(entry["question"]) == eval_split:
            rows.append({"question": f"{entry['question']}\n{INSTRUCTION}", "answer": str(entry["answer"]),
                         "info": {"entry": json.dumps(entry, default=str)}})
            if len(rows) == size:
                return Dataset.from_list(rows)
    raise ValueError(f"{task}({kwargs}) gave {len(rows)} {'eval' if eval_split else 'training'} questions of {size}")


def load_environment(task: str = "chain_sum", task_kwargs: dict | None = None, num_train: int = 2000,
                     num_eval: int = 200, seed: int = 0) -> vf.Environment:
    """``task`` of reasoning-gym (with ``task_kwargs``; chain_sum: one-digit a + b) as a single-turn environment:
    ``num_train`` training and ``num_eval`` eval questions drawn from ``seed``, the reward reasoning-gym's score
    of the reply's last number (1 for the right answer)."""
    kwargs = dict(task_kwargs or ({"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}
                                  if task == "chain_sum" else {}))
    scorer = reasoning_gym.create_dataset(task, size=1, seed=seed, **kwargs)

    def correct(completion, info, **_) -> float:
        """reasoning-gym's score_answer of the reply's last number."""
        text = completion[-1]["content"] if completion else ""
        return float(scorer.score_answer(answer=last_number(text or ""), entry=json.loads(info["entry"])))

    return vf.SingleTurnEnv(dataset=_split(task, kwargs, seed, num_train, False),
                            eval_dataset=_split(task, kwargs, seed + 1, num_eval, True),
                            rubric=vf.Rubric(funcs=[correct], weights=[1.0]))
