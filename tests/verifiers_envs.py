"""verifiers environments defined for the tests (``rollout.environment_id=tests.verifiers_envs``), written against
verifiers' classic API as Environments Hub packages are: ``load_environment(kind=...)`` returns

- ``single_turn``: a ``SingleTurnEnv`` asking for a sum, with a rubric of two weighted functions (``exact``:
  the answer appears in the reply, weight 1; ``even_length``: the reply has an even number of characters, weight
  0.5, a reward a random model can learn from) and, with ``group=True``, a group-level function
  (``distinct``: 1 for a reply no other episode of its group gave, weight 0.25); an eval dataset of its own;
- ``tools``: a ``ToolEnv`` with one tool (``add``), its rubric ``exact``, up to ``max_turns`` turns;
- ``multi_turn``: a ``MultiTurnEnv`` that answers every model turn with a user turn ("Are you sure?") for
  ``max_turns`` turns, its rubric ``exact`` and ``even_length`` of the last reply;
- ``raw``: a dataset of ``prompt`` messages and ``info`` only (no question, no answer), whose rubric records the
  input each rollout was given (``env.seen``) and scores 1;
- ``broken``: a ``MultiTurnEnv`` whose environment turn raises ``vf.Error`` (a failed rollout);
- ``judged``: a rubric holding an ``AsyncOpenAI`` client made when the environment is built, as ``JudgeRubric``
  does, which asks ``judge_url``'s ``/models`` for each rollout and scores 1 when it answers.
"""

from __future__ import annotations

import verifiers as vf
from datasets import Dataset


def _text(completion) -> str:
    last = completion[-1]
    return str((last["content"] if isinstance(last, dict) else last.content) or "")


def exact(completion, answer, **kwargs) -> float:
    """1 when the reference answer appears in the last reply."""
    return float(str(answer) in _text(completion))


def even_length(completion, **kwargs) -> float:
    """1 when the last reply has an even number of characters."""
    return float(len(_text(completion)) % 2 == 0)


def distinct(completions, **kwargs) -> list[float]:
    """A group-level function: 1 for each reply no other episode of the group gave."""
    texts = [_text(c) for c in completions]
    return [float(texts.count(t) == 1) for t in texts]


def add(a: int, b: int) -> int:
    """Adds two integers.

    Args:
        a: the first integer.
        b: the second integer.
    """
    return a + b


class AreYouSure(vf.MultiTurnEnv):
    """Asks again after every model turn, until ``max_turns`` model turns."""

    async def env_response(self, messages, state, **kwargs):
        return [vf.UserMessage(content="Are you sure?")]


class Broken(vf.MultiTurnEnv):
    """Its environment turn fails."""

    async def env_response(self, messages, state, **kwargs):
        raise vf.Error("the environment's own failure")


def _sums(n: int, offset: int) -> Dataset:
    pairs = [((7 * i + offset) % 40 + 1, (11 * i + 3 * offset) % 40 + 1) for i in range(n)]
    return Dataset.from_dict({"question": [f"What is {a} + {b}?" for a, b in pairs],
                              "answer": [str(a + b) for a, b in pairs]})


def load_environment(kind: str = "single_turn", num_train: int = 16, num_eval: int = 4, group: bool = False,
                     max_turns: int = 3, judge_url: str = "") -> vf.Environment:
    """A test environment (the module docstring): ``num_train`` training and ``num_eval`` eval questions."""
    train, held = _sums(num_train, 0), _sums(num_eval, 1000) if num_eval else None
    if kind == "single_turn":
        funcs, weights = [exact, even_length], [1.0, 0.5]
        if group:
            funcs, weights = [*funcs, distinct], [*weights, 0.25]
        return vf.SingleTurnEnv(dataset=train, eval_dataset=held, system_prompt="Answer with the number.",
                                rubric=vf.Rubric(funcs=funcs, weights=weights))
    if kind == "tools":
        return vf.ToolEnv(dataset=train, eval_dataset=held, tools=[add], max_turns=max_turns,
                          system_prompt="Use the add tool, then answer.", rubric=vf.Rubric(funcs=[exact]))
    if kind == "multi_turn":
        return AreYouSure(dataset=train, eval_dataset=held, max_turns=max_turns,
                          rubric=vf.Rubric(funcs=[exact, even_length], weights=[1.0, 0.5]))
    if kind == "raw":
        rows = Dataset.from_list([{"prompt": [{"role": "user", "content": f"Say {i}."}], "info": {"i": i}}
                                  for i in range(num_train)])
        seen: list[dict] = []

        def record(state, **kwargs) -> float:
            seen.append(dict(state["input"]))
            return 1.0

        env = vf.SingleTurnEnv(dataset=rows, rubric=vf.Rubric(funcs=[record]))
        env.seen = seen
        return env
    if kind == "broken":
        return Broken(dataset=train, max_turns=max_turns, rubric=vf.Rubric(funcs=[exact]))
    if kind == "judged":
        from openai import AsyncOpenAI

        judge = AsyncOpenAI(base_url=judge_url, api_key="x", max_retries=0)  # built once, as JudgeRubric's client

        async def judged(completion, **kwargs) -> float:
            return float(bool((await judge.models.list()).data))

        return vf.SingleTurnEnv(dataset=train, rubric=vf.Rubric(funcs=[judged]))
    raise ValueError(f"kind={kind!r}: single_turn, tools, multi_turn, raw, broken or judged")
