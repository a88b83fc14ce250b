"""The evaluation suites: fixed, versioned item sets (a suite's ``version`` goes up whenever its items,
prompts or grading change, so cached results of another version are never reused).

- ``reasoning`` suites run a training config's task in its environment (the job's prompts,
  ``data.instruction``, tools and turn limits, graded by its ``correctness`` function), greedy and
  with ``samples`` sampled episodes per problem: ``arithmetic`` (``grpo``: 200 held-out one-digit
  sums), ``arithmetic_tools`` (``grpo_tools``: 200 held-out 4-6 term sums, the calculator at hand),
  ``gsm8k`` (``grpo_gsm8k``: all 1,319 GSM8K test problems, the 200 held-out first), ``humaneval``
  (``grpo_humaneval``: all 164 problems, run in the sandbox);
- ``behaviour``: 100 held-out ``alpaca_en_demo`` instructions, greedy: length, refusals,
  repetition, empty and garbled answers (:func:`alignment.evaluation.metrics.behaviour`);
- ``preference``: 50 held-out ``dpo_en_demo`` prompts, greedy; a reward model judges each
  checkpoint's answer against the baseline's (win rate);
- ``regression``: ``evals/regression_v1.jsonl`` (or ``--regression-file``), greedy; an item the
  baseline answers and another checkpoint does not is a regression.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from alignment.compose import compose
from alignment.config import JobConfig, job_config
from alignment.data.chat_data import load_preference_pairs, load_sft_examples
from alignment.data.prompts import INSTRUCTIONS, job_prompts
from alignment.data.text_files import read_jsonl

ROOT = Path(__file__).resolve().parents[2]
REGRESSION_FILE = ROOT / "evals" / "regression_v1.jsonl"
KINDS = ("reasoning", "behaviour", "preference", "regression")
MATCHES = ("number", "contains")


@dataclass(frozen=True)
class Suite:
    """One suite: ``kind`` (:data:`KINDS`), ``config`` (a reasoning suite's job config under
    ``configs/``), ``splits`` (the task's splits it joins), ``size`` (chat suites: held-out prompts),
    ``max_tokens`` (the response budget; None: the config's ``rollout.eval_max_tokens``)."""

    name: str
    version: int
    kind: str
    description: str
    config: str | None = None
    splits: tuple[str, ...] = ("heldout",)
    size: int = 0
    max_tokens: int | None = None


SUITES: dict[str, Suite] = {s.name: s for s in (
    Suite("arithmetic", 1, "reasoning", "200 held-out one-digit sums", "grpo"),
    Suite("arithmetic_tools", 1, "reasoning", "200 held-out 4-6 term sums, calculator tool", "grpo_tools"),
    Suite("gsm8k", 1, "reasoning", "GSM8K's 1,319 test problems", "grpo_gsm8k", ("heldout", "train")),
    Suite("humaneval", 1, "reasoning", "HumanEval's 164 problems, sandboxed", "grpo_humaneval", ("heldout", "train")),
    Suite("behaviour", 1, "behaviour", "100 held-out alpaca_en_demo instructions", size=100, max_tokens=256),
    Suite("preference", 1, "preference", "50 held-out dpo_en_demo prompts, judged by --reward-model",
          size=50, max_tokens=256),
    Suite("regression", 1, "regression", "evals/regression_v1.jsonl: 36 questions that must stay right",
          max_tokens=256),
)}


def get_suites(names: str | list[str]) -> list[Suite]:
    """The suites named (a comma-separated string or a list), in order.

    Raises:
        ValueError: an unknown name (listing the valid ones).
    """
    names = [n.strip() for n in names.split(",")] if isinstance(names, str) else list(names)
    unknown = [n for n in names if n not in SUITES]
    if unknown or not names:
        raise ValueError(f"--suites: unknown {', '.join(unknown) or '(none given)'}; valid: {', '.join(SUITES)}")
    return [SUITES[n] for n in names]


def suite_config(suite: Suite) -> JobConfig:
    """A reasoning suite's job config, composed and typed (its task, environment and lengths)."""
    return job_config(compose(suite.config, []))


def problems(suite: Suite, cfg: JobConfig, limit: int | None = None) -> list:
    """A reasoning suite's problems (:class:`alignment.data.tasks.Problem`): the config's held-out
    split, then its train split when the suite joins both; the first ``limit`` when given."""

    sets = job_prompts(cfg.data, cfg.seed)
    items = list(sets.heldout) + (list(sets.train) if "train" in suite.splits else [])
    return items[:limit] if limit else items


def chat_prompts(suite: Suite, limit: int | None = None) -> list[list[dict]]:
    """A behaviour or preference suite's prompts (chat messages, the assistant's turn next)."""

    if suite.kind == "behaviour":
        items = [list(e.messages) for e in load_sft_examples("heldout", suite.size)]
    else:
        items = [list(p.messages) for p in load_preference_pairs("heldout", suite.size)]
    return items[:limit] if limit else items


def regression_items(path: str | Path | None = None, limit: int | None = None) -> list[dict]:
    """The regression file's items: JSON lines with ``id``, ``question``, ``answer``, ``match``
    (``number``: the response's final number equals ``answer``; ``contains``: ``answer`` appears in
    it, ignoring case) and an optional ``task`` (its instruction follows the question).

    Raises:
        FileNotFoundError: no file at ``path``.
        ValueError: a line that is not JSON, misses a field, repeats an id or has an unknown
            ``match`` or ``task`` (naming the file and line).
    """

    path = Path(path or REGRESSION_FILE)
    if not path.is_file():
        raise FileNotFoundError(f"--regression-file {path}: no such file")
    items, seen = [], set()
    for where, item in read_jsonl(path, "--regression-file"):
        if not isinstance(item, dict):
            raise ValueError(f"{where}: a record is a JSON object, not {type(item).__name__}")
        missing = [k for k in ("id", "question", "answer") if k not in item]
        if missing:
            raise ValueError(f"{where}: missing {', '.join(missing)} (each line needs id, question, answer)")
        item.setdefault("match", "number")
        if item["match"] not in MATCHES:
            raise ValueError(f"{where}: match={item['match']!r}; valid: {', '.join(MATCHES)}")
        if item.get("task") is not None and item["task"] not in INSTRUCTIONS:
            raise ValueError(f"{where}: task={item['task']!r}; valid: {', '.join(INSTRUCTIONS)}")
        if item["id"] in seen:
            raise ValueError(f"{where}: id {item['id']!r} appears twice")
        seen.add(item["id"])
        items.append(item)
    if not items:
        raise ValueError(f"{path}: no items")
    return items[:limit] if limit else items


def file_digest(path: str | Path | None = None) -> str:
    """sha256 of the regression file (part of its results' cache key)."""
    return hashlib.sha256(Path(path or REGRESSION_FILE).read_bytes()).hexdigest()
