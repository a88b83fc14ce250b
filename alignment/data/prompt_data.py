"""Prompt datasets of your own for the RL jobs (``data.train_files`` / ``data.heldout_files``), read
with Hugging Face ``datasets``: JSONL, JSON, Parquet, CSV, or a directory written by
``Dataset.save_to_disk``. The rows stay in the memory-mapped Arrow table; a rank only ever builds
the :class:`alignment.data.tasks.Problem` s of the prompts it is dealt (:class:`FileProblems`).

A record's prompt is the ``data.prompt_key`` column: a string, or a chat ``messages`` list (with an
optional system message first). Its reference answer, when the task has one, is ``data.answer_key``
(null: the ``answer`` column if there is one, else verl's ``reward_model.ground_truth``); every column
is handed to the reward functions (TRL's ``**kwargs``). A key may be dotted into a struct column
(``reward_model.ground_truth``), as verl's parquet files nest them. A record's images (TRL's and verl's
``images`` column, TRL's ``image``: paths, or the bytes a ``datasets`` Image column keeps) go where its
image parts or verl's ``<image>`` placeholders are, else before its text
(:func:`alignment.data.content.place_images`). Records whose prompt repeats an earlier one are dropped and counted. Without
a held-out file, ``data.heldout_fraction`` holds out the records whose prompt hashes into that
fraction (:func:`is_heldout`), so train and held-out are disjoint for every seed.

The order of training prompts is :class:`EpochOrder`: a fresh permutation of the training records
every epoch, drawn from ``seed`` and the epoch alone, so step ``s``'s prompts are a function of
``s``: a run resumed at any step, an epoch boundary included, trains every prompt exactly as often
as the uninterrupted run (the bug class of verl #7401).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from alignment.data.content import (content_parts, content_text, has_image_parts, image_key, place_images,
                                    record_image_list, record_images)
from alignment.data.images import resolve
from alignment.data.tasks import FILE_TASK, Problem
from alignment.data.text_files import check_utf8

__all__ = ["FORMATS", "ANSWER_COLUMNS", "read_table", "value_at", "columns_of", "has_key",
           "is_heldout", "FileProblems", "PromptSets", "load_prompt_files", "EpochOrder", "fit_prompts", "training_order"]

#: file suffix -> the ``datasets`` builder that reads it
FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
_HASH_SCALE = float(2**64)


def read_table(path: str, field: str = "data.train_files"):
    """``path`` as a ``datasets.Dataset``: a ``.jsonl`` / ``.json`` / ``.parquet`` / ``.csv`` file
    (``datasets.load_dataset``, cached as Arrow and memory-mapped) or a directory written by
    ``Dataset.save_to_disk`` (a ``DatasetDict``'s ``train`` split, or its only one).

    Raises:
        FileNotFoundError: no such file or directory (naming ``field``).
        ValueError: an unknown suffix, a text file that is not UTF-8 (:func:`check_utf8`), a file
            ``datasets`` cannot parse, a DatasetDict without a ``train`` split among several, or no rows.
    """
    import datasets

    p = Path(path).expanduser()
    if p.is_dir():
        try:
            ds = datasets.load_from_disk(str(p))
        except (FileNotFoundError, ValueError) as e:
            raise ValueError(f"{field}={path}: a directory must be written by Dataset.save_to_disk ({e})") from e
        if isinstance(ds, datasets.DatasetDict):
            if "train" not in ds and len(ds) != 1:
                raise ValueError(f"{field}={path}: a DatasetDict with splits {list(ds)}; save one split, or "
                                 "name it train")
            ds = ds["train"] if "train" in ds else next(iter(ds.values()))
    elif not p.is_file():
        raise FileNotFoundError(f"{field}={path}: no such file or directory (give a .jsonl, .json, .parquet or .csv "
                                "file, or a directory written by Dataset.save_to_disk)")
    elif p.suffix not in FORMATS:
        raise ValueError(f"{field}={path}: unknown format {p.suffix!r}; valid: {', '.join(FORMATS)} or a "
                         "Dataset.save_to_disk directory")
    else:
        if p.suffix != ".parquet":
            check_utf8(p, field)  # a text format: a byte that is not UTF-8 named by its line, not by datasets
            if p.read_text(encoding="utf-8").strip() in ("", "[]"):  # datasets' own error here: an IndexError
                raise ValueError(f"{field}={path}: the file holds no records")
        datasets.disable_progress_bars()
        try:
            ds = datasets.load_dataset(FORMATS[p.suffix], data_files=str(p), split="train")
        except Exception as e:  # datasets raises its own DatasetGenerationError, pyarrow's errors, ...
            cause = e.__cause__ or e
            raise ValueError(f"{field}={path}: {FORMATS[p.suffix]} reader failed: {str(cause).splitlines()[0][:300]}"
                             ) from e
    if len(ds) == 0:
        raise ValueError(f"{field}={path}: no records")
    return _undecoded_images(ds)


def _undecoded_images(ds):
    """``ds`` with its image columns (a ``datasets`` ``Image`` feature, or a list of them: verl's and TRL's
    ``images``) left as ``{bytes, path}`` structs, not decoded: a rank decodes only the images of the prompts it
    is dealt (:func:`alignment.data.content.image_path` writes their bytes to files once)."""
    import datasets

    for name, feature in ds.features.items():
        inner = feature.feature if isinstance(feature, (datasets.Sequence, datasets.LargeList)) else \
            feature[0] if isinstance(feature, list) and feature else feature
        if isinstance(inner, datasets.Image) and inner.decode:
            undecoded = datasets.Image(decode=False)
            ds = ds.cast_column(name, datasets.Sequence(undecoded) if inner is not feature else undecoded)
    return ds


def value_at(record: dict, key: str):
    """The value of the dotted ``key`` in ``record`` (``reward_model.ground_truth``: the ``ground_truth`` field of
    the ``reward_model`` column); None where a part is missing."""
    value = record
    for part in key.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return value


def _fields(feature, prefix: str) -> list[str]:
    if isinstance(feature, dict):
        return [f for k, v in feature.items() for f in _fields(v, f"{prefix}.{k}")]
    return [prefix]


def columns_of(table) -> list[str]:
    """The table's columns, nested fields of struct columns dotted (``reward_model.ground_truth``)."""
    return [f for name, feature in table.features.items() for f in _fields(feature, name)]


def has_key(table, key: str) -> bool:
    """Whether the dotted ``key`` names a column, or a field of a struct column, of ``table``."""
    feature = table.features
    for part in key.split("."):
        if not isinstance(feature, dict) or part not in feature:
            return False
        feature = feature[part]
    return True


def prompt_text(prompt, images=None) -> str:
    """The text a prompt is known by (for de-duplication and the held-out hash): the string itself,
    or the messages as JSON, and the record's ``images`` files when it has any (the same question
    about another image is another prompt)."""
    text = prompt if isinstance(prompt, str) else json.dumps(prompt, sort_keys=True, ensure_ascii=False)
    return text + ("\n" + json.dumps(list(images)) if images else "")


def is_heldout(text: str, fraction: float) -> bool:
    """Whether the prompt ``text`` is held out under ``data.heldout_fraction``: its sha256, read as a
    number in [0, 1), is below ``fraction`` (no seed: the split is the same for every run)."""
    digest = hashlib.sha256(text.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "little") / _HASH_SCALE < fraction


def _messages(where: str, prompt) -> tuple[dict, ...]:
    if not isinstance(prompt, list) or not prompt:
        raise ValueError(f"{where}: the prompt must be a non-empty string or a list of chat messages")
    out = []
    for m in prompt:
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, list) and m.get("role") == "user":
            content = content_parts(where, content)
        if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant") \
                or not isinstance(content, (str, list)):
            raise ValueError(f"{where}: a message is {{role: system|user|assistant, content: string (a user's: or a "
                             f"list of text and image parts)}}, got {m!r:.120}")
        out.append({"role": m["role"], "content": content})
    if out[-1]["role"] != "user":
        raise ValueError(f"{where}: a chat prompt must end with a user message (the model answers it)")
    return tuple(out)


def _check_prompt(where: str, prompt) -> None:
    if isinstance(prompt, str):
        if not prompt.strip():
            raise ValueError(f"{where}: the prompt is empty")
        return
    msgs = [m for m in _messages(where, prompt) if m["role"] == "user"]
    if not any(content_text(m["content"]).strip() for m in msgs) and not has_image_parts(msgs):
        raise ValueError(f"{where}: the prompt's user messages are empty")


class FileProblems(Sequence):
    """The records ``rows`` of an Arrow table as :class:`alignment.data.tasks.Problem` s, built on
    access (``task`` :data:`alignment.data.tasks.FILE_TASK`; ``question`` the prompt string, or the
    last user message's text of a chat prompt, whose messages are ``Problem.messages`` and whose image
    parts' files (TRL's ``images`` column, relative to the record's file) are ``Problem.images``;
    ``answer`` the ``answer_key`` column as a string, "" without one; ``columns`` every column but the
    prompt). ``source``: where the rows come from, for messages; ``files``: ``(path, records)`` of each
    file the table was read from, in order (image paths resolve against their record's file)."""

    def __init__(self, table, rows: np.ndarray, prompt_key: str, answer_key: str | None, source: str,
                 files: Sequence[tuple[str, int]] = ()):
        self.table, self.rows, self.prompt_key, self.answer_key, self.source = table, rows, prompt_key, answer_key, source
        self.files = list(files)

    def __len__(self) -> int:
        return len(self.rows)

    def empty(self, key: str) -> bool:
        """Whether the dotted ``key`` is missing, null or empty (``""``, ``[]``, ``{}``) in every one of these
        records (read a column at a time, in batches)."""
        rows = set(self.rows.tolist())
        column = key.split(".")[0]
        if column not in self.table.column_names:
            return True
        start = 0
        for batch in self.table.select_columns([column]).iter(batch_size=4096):
            values = batch[column]
            for j, value in enumerate(values):
                if start + j in rows:
                    value = value_at({column: value}, key)
                    if value is not None and (not hasattr(value, "__len__") or len(value)) \
                            and not (isinstance(value, str) and not value.strip()):
                        return False
            start += len(values)
        return True

    def _folder(self, row: int) -> Path:
        start = 0
        for path, n in self.files:
            if row < start + n:
                return Path(path).expanduser().parent
            start += n
        return Path(".")

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        row = int(self.rows[i])
        record = self.table[row]
        prompt = value_at(record, self.prompt_key)
        columns = {k: v for k, v in record.items() if k != self.prompt_key}
        answer = value_at(record, self.answer_key) if self.answer_key else None
        pictures = record_image_list(record)
        if isinstance(prompt, str) and not pictures:
            return Problem(prompt, "" if answer is None else str(answer), FILE_TASK, columns=columns)
        where = f"{self.source} row {row}"
        msgs = _messages(where, [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt)
        msgs = place_images(where, msgs, len(pictures))  # verl's <image> placeholders, or TRL's place
        images = tuple(resolve(f, self._folder(row)) for f in record_images(where, record, msgs)) \
            if has_image_parts(msgs) else ()
        return Problem(content_text(msgs[-1]["content"]), "" if answer is None else str(answer), FILE_TASK,
                       messages=msgs, columns=columns, images=images)


@dataclass
class PromptSets:
    """An RL job's prompts: ``train`` and ``heldout`` (sequences of Problems) and what was read:
    ``records`` (rows read), ``duplicates`` (dropped: a prompt seen before; a training prompt that is
    also a held-out one is dropped from training), ``sources``, ``overlong`` (prompts dropped as too
    long, ``data.overlong_prompts=drop``) and ``tokens`` (prompt tokens of the kept prompts; 0: not
    counted)."""

    train: Sequence
    heldout: Sequence
    records: int = 0
    duplicates: int = 0
    sources: tuple[str, ...] = ()
    overlong: int = 0
    tokens: int = 0
    fingerprint: str = ""  # sha256 of the training prompts and answers in order ("": not computed)
    longest: int = 0  # tokens of the longest kept prompt, both splits (0: not counted)
    unused_columns: tuple[str, ...] = ()  # the files' columns the job does not read (start-up summary)

    def summary(self) -> str:
        """One line for the start of a run: records read, what was dropped, the split sizes and tokens."""
        tokens = f" ({self.tokens:,} prompt tokens)" if self.tokens else ""
        return (f"data: {self.records} records from {', '.join(self.sources)}; dropped {self.duplicates} duplicate "
                f"and {self.overlong} overlong prompts; {len(self.train)} training prompts, {len(self.heldout)} held "
                f"out{tokens}")


#: the reference answer's column when ``data.answer_key`` is null, the first the files have: TRL's and the
#: demo sets' ``answer``, then verl's ``reward_model.ground_truth`` (what verl's reward manager hands
#: ``compute_score`` as ``ground_truth``)
ANSWER_COLUMNS = ("answer", "reward_model.ground_truth")


def _resolve_keys(table, where: str, prompt_key: str, answer_key: str | None) -> str | None:
    """``data.prompt_key`` and ``data.answer_key`` (dotted into struct columns) checked against the table; returns
    the answer's key (null: the first of :data:`ANSWER_COLUMNS` the table has, or None)."""
    if not has_key(table, prompt_key):
        raise ValueError(f"data.prompt_key={prompt_key!r}: {where} has no such column; its columns are "
                         f"{', '.join(columns_of(table))}")
    if answer_key is None:
        return next((k for k in ANSWER_COLUMNS if has_key(table, k)), None)
    if not has_key(table, answer_key):
        raise ValueError(f"data.answer_key={answer_key!r}: {where} has no such column; its columns are "
                         f"{', '.join(columns_of(table))} (a dotted key names a field of a struct column; null: "
                         "answer, else reward_model.ground_truth, else no reference answer)")
    return answer_key


def _check_responses(table, rows: np.ndarray, where: str, key: str) -> None:
    """``data.response_key`` (``algorithm.distill_samples=dataset``): a column of the training files
    whose every kept row is a non-empty string."""
    if not has_key(table, key):
        raise ValueError(f"data.response_key={key!r}: {where} has no such column; its columns are "
                         f"{', '.join(columns_of(table))}")
    answers = table.select_columns([key.split(".")[0]])
    for row in rows.tolist():
        text = value_at(answers[int(row)], key)
        if not isinstance(text, str) or not text.strip():
            raise ValueError(f"{where} row {row} ({key}): the answer to distill on is {text!r}; give every training "
                             "record a non-empty string (algorithm.distill_samples=dataset)")


def _files(value) -> list[str]:
    if value is None:
        return []
    return [value] if isinstance(value, str) else [str(v) for v in value]


def _read(paths: list[str], field: str):
    """The files ``paths`` as one table, and ``(path, records)`` of each, in order."""
    import datasets

    tables = [read_table(p, field) for p in paths]
    files = [(p, len(t)) for p, t in zip(paths, tables)]
    if len(tables) == 1:
        return tables[0], files
    try:
        return datasets.concatenate_datasets(tables), files
    except ValueError as e:
        raise ValueError(f"{field}={paths}: the files' columns differ ({e})") from e


def _distinct_rows(table, prompt_key: str, source: str, seen: set[bytes], keep=lambda text: True):
    """Rows whose prompt is valid, kept by ``keep``, and not in ``seen`` (16-byte digests of the prompts
    seen so far, with their ``images`` files; it grows); and the number of repeats dropped. The prompt
    column is read in batches, so a rank never holds the whole column as Python objects."""
    rows, dropped, i = [], 0, 0
    column = prompt_key.split(".")[0]
    pictures = [c for c in ("images", "image") if c in table.column_names and c != column]
    for batch in table.select_columns([column, *pictures]).iter(batch_size=4096):
        n = len(batch[column])
        for j in range(n):
            record = {k: batch[k][j] for k in batch}
            prompt = value_at(record, prompt_key)
            _check_prompt(f"{source} row {i} ({prompt_key})", prompt)
            text = prompt_text(prompt, [image_key(x) for x in record_image_list(record)])
            digest = hashlib.blake2b(text.encode("utf-8"), digest_size=16).digest()
            if keep(text):
                if digest in seen:
                    dropped += 1
                else:
                    seen.add(digest)
                    rows.append(i)
            i += 1
    return np.asarray(rows, dtype=np.int64), dropped


def load_prompt_files(data) -> PromptSets:
    """``data.train_files`` (and ``data.heldout_files``, or ``data.heldout_fraction`` of the training
    records) as :class:`PromptSets`. ``data``: the job's ``data`` config section.

    Raises:
        FileNotFoundError, ValueError: as :func:`read_table`; a missing ``prompt_key`` /
            ``answer_key`` / ``response_key`` column (naming the columns there are); an empty or malformed prompt
            or response
            (naming the file and row); no training prompt left.
    """
    train_paths, heldout_paths = _files(data.train_files), _files(data.heldout_files)
    fraction = float(data.heldout_fraction or 0.0)
    table, files = _read(train_paths, "data.train_files")
    where = ", ".join(train_paths)
    answer_key = _resolve_keys(table, where, data.prompt_key, data.answer_key)
    seen: set[bytes] = set()
    heldout: Sequence = []
    duplicates, records = 0, len(table)
    if heldout_paths:
        h_table, h_files = _read(heldout_paths, "data.heldout_files")
        h_where = ", ".join(heldout_paths)
        h_answer = _resolve_keys(h_table, h_where, data.prompt_key, data.answer_key)
        h_rows, duplicates = _distinct_rows(h_table, data.prompt_key, h_where, seen)
        heldout = FileProblems(h_table, h_rows, data.prompt_key, h_answer, h_where, h_files)
        records += len(h_table)
    elif fraction > 0:
        h_rows, duplicates = _distinct_rows(table, data.prompt_key, where, seen,
                                            keep=lambda text: is_heldout(text, fraction))
        heldout = FileProblems(table, h_rows, data.prompt_key, answer_key, where, files)
    rows, dropped = _distinct_rows(table, data.prompt_key, where, seen,
                                   keep=lambda text: not (fraction and not heldout_paths and is_heldout(text, fraction)))
    # a training prompt that is also a held-out file's prompt counts as a duplicate and is dropped
    if getattr(data, "response_key", None):
        _check_responses(table, rows, where, data.response_key)
    if not len(rows):
        raise ValueError(f"data.train_files={where}: no training prompt left ({records} records, {duplicates + dropped} "
                         f"duplicates{', the rest held out' if fraction else ''})")
    return PromptSets(FileProblems(table, rows, data.prompt_key, answer_key, where, files), heldout, records,
                      duplicates + dropped, tuple(train_paths + heldout_paths))


class EpochOrder(Sequence):
    """The training items in the order the steps take them: epoch after epoch, each a permutation
    of ``items`` drawn from ``seed + epoch`` (``shuffle``; epoch 0 keeps ``items``' order when
    ``keep_first``: a built-in task's problems are already a seeded random draw). ``order[i]`` is
    the ``i``-th prompt trained on, so step ``s`` takes ``order[s * P : (s + 1) * P]``, a function of
    ``s`` alone. Indexable without end (``len``: one epoch)."""

    def __init__(self, items: Sequence, seed: int, shuffle: bool = True, keep_first: bool = False):
        self.items, self.seed, self.shuffle, self.keep_first = items, seed, shuffle, keep_first
        self._perm: tuple[int, np.ndarray] | None = None

    def __len__(self) -> int:
        return len(self.items)

    def permutation(self, epoch: int) -> np.ndarray:
        """Epoch ``epoch``'s order of ``items``' indices."""
        n = len(self.items)
        if not self.shuffle or (epoch == 0 and self.keep_first):
            return np.arange(n)
        if self._perm is None or self._perm[0] != epoch:
            self._perm = (epoch, np.random.default_rng([self.seed, epoch]).permutation(n))
        return self._perm[1]

    def index(self, i: int) -> tuple[int, int]:
        """``(epoch, item index)`` of the ``i``-th prompt trained on."""
        epoch, k = divmod(i, len(self.items))
        return epoch, int(self.permutation(epoch)[k])

    def __getitem__(self, i: int):
        return self.items[self.index(i)[1]]


def _keep(items: Sequence, keep: list[int]) -> Sequence:
    if isinstance(items, FileProblems):
        return FileProblems(items.table, items.rows[np.asarray(keep, dtype=np.int64)], items.prompt_key,
                            items.answer_key, items.source, items.files)
    return [items[i] for i in keep]


def fit_prompts(sets: PromptSets, length, max_model_len: int, max_tokens: int, policy: str, field: str) -> PromptSets:
    """``sets`` with every prompt's token count (``length(problem)``) checked against what
    ``max_model_len`` leaves after ``max_tokens`` of response: ``policy`` ``error`` refuses a longer
    one (naming the longest), ``drop`` leaves them out (counted in ``overlong``). The result's
    ``tokens``: the prompt tokens of the kept prompts, both splits (``longest``: the most in one);
    ``fingerprint``: the sha256 of the
    kept training prompts and answers in order (a resume checks it).

    Raises:
        ValueError: a prompt too long with ``error`` (naming it, its length and the fixes), or no
            training prompt left.
    """
    budget, total, dropped, kept, longest, most = max_model_len - max_tokens, 0, 0, [], (0, ""), 0
    digest = hashlib.sha256()
    for items in (sets.train, sets.heldout):
        keep = []
        for i in range(len(items)):
            problem = items[i]
            n = length(problem)
            if n > budget:
                dropped += 1
                longest = max(longest, (n, problem.question))
                continue
            total += n
            most = max(most, n)
            keep.append(i)
            if items is sets.train:
                digest.update(json.dumps([problem.messages or problem.question, problem.answer,
                                          *([list(problem.images)] if problem.images else [])]).encode() + b"\n")
        kept.append(_keep(items, keep) if len(keep) < len(items) else items)
    if dropped and policy == "error":
        raise ValueError(f"{field}: the longest prompt has {longest[0]} tokens ({longest[1][:60]!r}...), which with "
                         f"rollout.max_tokens={max_tokens} exceeds rollout.max_model_len={max_model_len}: raise "
                         "rollout.max_model_len, lower rollout.max_tokens, or set data.overlong_prompts=drop "
                         f"({dropped} prompts are too long)")
    if not len(kept[0]):
        raise ValueError(f"{field}: every training prompt is longer than the {budget} tokens rollout.max_model_len="
                         f"{max_model_len} leaves after rollout.max_tokens={max_tokens}")
    return PromptSets(kept[0], kept[1], sets.records, sets.duplicates, sets.sources, overlong=dropped, tokens=total,
                      fingerprint=digest.hexdigest(), longest=most)


def training_order(d, seed: int, prompts):
    """The order an RL job's steps take ``prompts.train`` (a :class:`PromptSets`) in, as an
    :class:`EpochOrder`: reshuffled every epoch from the job's ``seed`` (``d``: its ``data`` section,
    ``data.shuffle``); a built-in task's first epoch in its own order (already a seeded random draw; its
    ``sources`` name ``data.task``), an environment's dataset or a file's shuffled from the first."""
    builtin = bool(prompts.sources) and all(str(s).startswith("data.task=") for s in prompts.sources)
    return EpochOrder(prompts.train, seed, shuffle=d.shuffle, keep_first=builtin and not d.train_files)
