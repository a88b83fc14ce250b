"""Step-supervised data for the process reward model: records in TRL's stepwise-supervision
format (``prompt``, ``completions`` = the steps, ``labels`` = one per step), written by
``tools/make_prm_data.py`` as ``<dir>/train.jsonl`` and ``<dir>/heldout.jsonl``, and their
tokenisation with the score read at each step's last token.

A response's steps are its lines (``separator``, default ``"\\n"``); empty lines are not steps.
Tokenised for the PRM, step ``k`` is its own text's tokens followed by the separator's (the last
step by the end-of-turn token instead), as TRL's ``PRMTrainer`` builds rows: the step ends where
the separator is, whatever the text around it.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from alignment.data.chat_data import encode_prompt
from alignment.data.prompt_data import read_table
from alignment.data.step_labels import arithmetic_step_label
from alignment.data.text_files import read_jsonl

__all__ = ["STEP_INSTRUCTION", "step_prompt", "StepRecord", "step_spans", "split_steps", "response_steps",
           "label_steps", "supervised_labels", "encode_steps", "write_records", "load_records", "SUPERVISIONS"]

#: Asks for one arithmetic operation per line, so that each line can be checked on its own.
STEP_INSTRUCTION = "Solve it step by step: one operation per line, written as 'a + b = c', then the answer."


def step_prompt(question: str) -> str:
    """The user message asking ``question`` for a step-by-step solution."""
    return f"{question.strip()}\n{STEP_INSTRUCTION}"


SPLIT_FILES = {"train": "train.jsonl", "heldout": "heldout.jsonl"}
#: process: each step's own label (PRM, Lightman et al. 2023) | outcome: the final answer's correctness at
#: the last step only (their outcome-supervised reward model, ORM)
SUPERVISIONS = ("process", "outcome")


@dataclass
class StepRecord:
    """One sampled solution: the user message (``prompt``), its steps (``completions``), one label
    per step (True / False; None: the step could not be checked and is not trained on), the
    problem's ``question`` and reference ``answer``, and whether the final answer is right
    (``outcome``)."""

    prompt: str
    completions: list[str]
    labels: list[bool | None]
    question: str = ""
    answer: str = ""
    outcome: bool = False


def step_spans(response: str, separator: str = "\n") -> list[tuple[int, int]]:
    """``(start, end)`` character offsets (end exclusive) of each step of ``response``: its pieces
    between separators, blank ones dropped, without surrounding whitespace.

    Raises:
        ValueError: an empty ``separator``.
    """
    if not separator:
        raise ValueError("the step separator is empty: give a string, e.g. '\\n'")
    spans, start = [], 0
    for piece in response.split(separator):
        stripped = piece.strip()
        if stripped:
            begin = start + piece.index(stripped)
            spans.append((begin, begin + len(stripped)))
        start += len(piece) + len(separator)
    return spans


def split_steps(response: str, separator: str = "\n") -> list[str]:
    """The steps of ``response`` (:func:`step_spans`). ``"3 + 4 = 7\\n\\n7 + 1 = 8"`` -> ``["3 + 4 = 7",
    "7 + 1 = 8"]``.

    Raises:
        ValueError: an empty ``separator``.
    """
    return [response[a:b] for a, b in step_spans(response, separator)]


def response_steps(tokenizer, response_ids: list[int], separator: str = "\n") -> tuple[list[str], list[int]]:
    """The steps of a generated response and, for each, the index of the response token that
    completes its text (where a dense reward for the step is placed): the first token whose
    prefix decodes past the step's last character (special tokens skipped, as vLLM's text).

    Returns:
        ``(steps, positions)``, positions increasing in ``[0, len(response_ids))``.
    """
    text = tokenizer.decode(response_ids, skip_special_tokens=True)
    spans = step_spans(text, separator)
    decoded = lambda k: len(tokenizer.decode(response_ids[: k + 1], skip_special_tokens=True))  # noqa: E731
    positions, t = [], 0
    for _, end in spans:
        while t < len(response_ids) - 1 and decoded(t) < end:
            t += 1
        positions.append(t)
    return [text[a:b] for a, b in spans], positions


def label_steps(steps: list[str]) -> list[bool | None]:
    """Automatic labels (:func:`alignment.data.step_labels.arithmetic_step_label`): True when a
    step's equations hold, False when one does not, None when it has none."""
    return [None if (y := arithmetic_step_label(s)) is None else bool(y) for s in steps]


def supervised_labels(record: StepRecord, supervision: str) -> list[bool | None]:
    """The labels a reward model is trained on: the steps' own (``process``) or, for an outcome
    reward model, None everywhere but the last step, which holds ``record.outcome`` (``outcome``).

    Raises:
        ValueError: an unknown ``supervision``.
    """
    if supervision not in SUPERVISIONS:
        raise ValueError(f"supervision={supervision!r}: valid values are {', '.join(SUPERVISIONS)}")
    if supervision == "process":
        return list(record.labels)
    return [None] * (len(record.completions) - 1) + [record.outcome] if record.completions else []


def encode_steps(tokenizer, prompt: str | list[int], steps: list[str], separator: str = "\n",
                 max_length: int | None = None) -> tuple[list[int], int, list[int]]:
    """Token ids of the chat prompt (one user message ``prompt``, or the prompt's token ids as
    given) followed by the steps, the prompt length, and the position of each step's last token
    (where the head scores it).

    Step ``k`` is ``tokenizer.encode(steps[k])`` then the separator's ids, the last step closed
    by ``tokenizer.eos_token_id`` (the end of the assistant turn) instead. With ``max_length``,
    steps that would end past it are dropped (so fewer positions than steps come back).

    Returns:
        ``(ids, prompt_len, step_ends)``; ``step_ends[k] < len(ids)``, increasing.
    Raises:
        ValueError: no steps, a tokenizer without an EOS token, or a prompt leaving no room for one step.
    """
    if not steps:
        raise ValueError("a solution with no steps cannot be scored")
    if tokenizer.eos_token_id is None:
        raise ValueError("the tokenizer has no eos_token_id to close the last step with")
    ids = encode_prompt(tokenizer, [{"role": "user", "content": prompt}]) if isinstance(prompt, str) else list(prompt)
    prompt_len, ends = len(ids), []
    sep = tokenizer.encode(separator, add_special_tokens=False)
    for k, step in enumerate(steps):
        piece = tokenizer.encode(step, add_special_tokens=False) + (sep if k < len(steps) - 1
                                                                     else [tokenizer.eos_token_id])
        if max_length is not None and len(ids) + len(piece) > max_length:
            break
        ids += piece
        ends.append(len(ids) - 1)
    if not ends:
        raise ValueError(f"data.max_length={max_length} leaves no room for the first step after a "
                         f"{prompt_len}-token prompt; raise data.max_length")
    return ids, prompt_len, ends


def write_records(path: Path, records: list[StepRecord]) -> None:
    """One JSON object per line (TRL's stepwise-supervision fields plus ours), written atomically."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        for r in records:
            f.write(json.dumps(asdict(r)) + "\n")
    tmp.replace(path)


#: the forms a split may take in the data directory, in the order looked for: JSON lines, Parquet, or a
#: ``Dataset.save_to_disk`` directory (TRL's stepwise-supervision columns: prompt, completions, labels)
SPLIT_FORMS = (".jsonl", ".parquet", "")


def split_path(directory: str | Path, split: str) -> Path | None:
    """The file (or saved dataset directory) holding ``split`` in ``directory``; None: none there."""
    stem = Path(directory) / Path(SPLIT_FILES[split]).stem
    for suffix in SPLIT_FORMS:
        path = stem.with_name(stem.name + suffix)
        if (path.is_dir() if not suffix else path.is_file()):
            return path
    return None


RECORD_FIELDS = ("prompt", "completions", "labels", "question", "answer", "outcome")


def _step_record(where: str, d) -> StepRecord:
    try:
        r = StepRecord(**d)
        bad = (not isinstance(r.prompt, str) or not isinstance(r.completions, list)
               or len(r.completions) != len(r.labels) or any(y not in (True, False, None) for y in r.labels))
    except TypeError as e:
        raise ValueError(f"{where}: not a step record ({e})") from e
    if bad:
        raise ValueError(f"{where}: a record needs a prompt string and as many labels (true/false/null) "
                         f"as completions (steps)")
    return r


def load_records(directory: str | Path, split: str) -> list[StepRecord]:
    """The records of ``split`` in ``directory``: ``{train,heldout}.jsonl``, ``.parquet`` or a saved
    dataset directory (:func:`split_path`), with TRL's stepwise columns ``prompt``, ``completions``,
    ``labels`` (and optionally ``question``, ``answer``, ``outcome``).

    Raises:
        FileNotFoundError: the split is missing (the message has the command that writes it).
        ValueError: an unknown ``split``, or a line / row that is not a record (file and place named).
    """
    if split not in SPLIT_FILES:
        raise ValueError(f"split={split!r}: valid values are {', '.join(SPLIT_FILES)}")
    path = split_path(directory, split)
    if path is None:
        raise FileNotFoundError(f"{Path(directory) / SPLIT_FILES[split]} does not exist (nor .parquet, nor a saved "
                                f"dataset): write step-labelled data with `python tools/make_prm_data.py --out "
                                f"{directory}`")
    records = []
    if path.suffix == ".jsonl":
        records = [_step_record(where, d) for where, d in read_jsonl(path, "data.dataset")]
    else:
        for n, row in enumerate(read_table(str(path), "data.dataset")):
            records.append(_step_record(f"{path} row {n}", {k: v for k, v in row.items() if k in RECORD_FIELDS}))
    if not records:
        raise ValueError(f"{path} holds no records")
    return records
