"""HumanEval as a task: its fixed held-out split, code taken from responses, the program that grades
them, and grading in the sandbox (canonical solutions pass, wrong and runaway ones fail)."""

from __future__ import annotations

import pytest

from alignment.data.code_tasks import check_program, extract_code, load_humaneval, score_code
from alignment.data.tasks import load_problems, score_response


def test_split_is_fixed_and_disjoint():
    heldout, train = load_humaneval("heldout", 41), load_humaneval("train", 123)
    ids = {p["task_id"] for p in heldout}
    train_ids = {p["task_id"] for p in train}
    assert len(ids) == 41 and not ids & train_ids and len(ids | train_ids) == 164
    assert [p["task_id"] for p in load_humaneval("heldout", 5)] == [p["task_id"] for p in heldout[:5]]
    assert [p["task_id"] for p in load_humaneval("train", 5, seed=1)] != [p["task_id"] for p in train[:5]]
    with pytest.raises(ValueError, match="HumanEval's heldout split has 41 problems, asked for size=42"):
        load_humaneval("heldout", 42)
    problems = load_problems("humaneval", "heldout", 3)
    assert [p.task for p in problems] == ["humaneval"] * 3 and problems[0].question == heldout[0]["prompt"]


def test_code_is_taken_from_the_last_block():
    assert extract_code("Here:\n```python\ndef f():\n    return 1\n```\nDone.") == "def f():\n    return 1\n"
    assert extract_code("```\nx = 1\n```\n```py\nx = 2\n```") == "x = 2\n"  # the last block
    assert extract_code("```python\ndef f():\n    return 2") == "def f():\n    return 2"  # unclosed: to the end
    assert extract_code("    return a + b\n") == "    return a + b\n"  # no block: the whole response


def test_the_grading_program():
    problem = {"prompt": "from typing import List\n\n\ndef add(xs: List[int]) -> int:\n    \"\"\"Sum.\"\"\"\n",
               "test": "def check(candidate):\n    assert candidate([1, 2]) == 3\n", "entry_point": "add"}
    # a block that defines the function replaces the prompt, whose imports stay
    program = check_program(problem, "```python\ndef add(xs):\n    return sum(xs)\n```")
    assert program == ("from typing import List\ndef add(xs):\n    return sum(xs)\n\n\n"
                       "def check(candidate):\n    assert candidate([1, 2]) == 3\n\ncheck(add)\n")
    # a body continues the prompt (HumanEval's completion format)
    assert check_program(problem, "    return sum(xs)\n").startswith(problem["prompt"] + "    return sum(xs)\n")
    assert score_code(problem, "    return sum(xs)\n") == 1.0
    assert score_code(problem, "    return 0\n") == 0.0


def test_canonical_solutions_pass_and_wrong_or_runaway_ones_fail():
    problems = load_problems("humaneval", "heldout", 8)
    for p in problems:
        e = p.entry
        assert score_response(p, f"```python\n{e['prompt']}{e['canonical_solution']}```") == 1.0, e["task_id"]
        assert score_response(p, e["canonical_solution"]) == 1.0, e["task_id"]  # the body alone
        assert score_response(p, f"```python\n{e['prompt']}    return None\n```") == 0.0, e["task_id"]
    e = problems[0].entry
    assert score_response(problems[0], f"```python\n{e['prompt']}    while True:\n        pass\n```") == 0.0
    assert score_response(problems[0], "import os\nos.system('echo hi')") == 0.0  # refused by the sandbox


def test_correctness_reward_runs_the_sandboxes_side_by_side():
    from alignment.rewards.text import text_scores
    from alignment.data.samples import Sample
    from alignment.sandbox.runner import sandbox_workers

    problems = load_problems("humaneval", "heldout", 6)
    texts = [p.entry["canonical_solution"] if i % 2 == 0 else "    return None\n" for i, p in enumerate(problems)]
    samples = [Sample([1], [2], [0.0], t, True) for t in texts]
    assert text_scores("correctness", problems, samples, 16).tolist() == [1.0, 0.0] * 3  # in sample order
    assert sandbox_workers() >= 1
