"""A fixed-data job's examples (SFT, reward model, DPO family, process reward model), read from
``data.dataset`` and tokenized with the model's chat template into the rows the offline trainers
(:mod:`alignment.trainers.offline`) batch."""

from __future__ import annotations

from alignment.algorithms.config import AlgorithmConfig
from alignment.data.chat_data import encode_example, load_preference_pairs, load_sft_examples
from alignment.data.config import DataConfig
from alignment.data.step_data import encode_steps, load_records, supervised_labels


def tokenize_split(d: DataConfig, a: AlgorithmConfig, tokenizer, split: str) -> list[list[tuple]]:
    """Per example, its rows ``(ids, prompt_len)``: one for SFT, ``[chosen, rejected]`` for pairs;
    for the PRM one ``(ids, prompt_len, step_ends, labels)`` per solution with a labelled step
    (:func:`tokenize_steps`). ``data.columns`` renames a file's columns; held out are
    ``data.heldout_files``, else ``data.heldout_fraction`` by prompt hash, else the last
    ``data.heldout_size``; training takes the first ``data.train_size`` (null: all).

    Raises:
        FileNotFoundError, ValueError: a data file missing or a record that cannot be read, named
            with its file and line (:mod:`alignment.data.chat_data`, :mod:`alignment.data.step_data`),
            or an example the chat template does not render as a prompt prefix.
    """
    enc = lambda msgs, resp: encode_example(tokenizer, msgs, resp, d.max_length, d.max_prompt_length)  # noqa: E731
    if a.name == "prm":
        out = [[row] for row in tokenize_steps(d, a, tokenizer, split)]
        return out[: d.train_size] if split == "train" else out[: d.heldout_size]
    kw = {"heldout_files": d.heldout_files, "heldout_fraction": float(d.heldout_fraction or 0.0),
          "columns": dict(d.columns or {})}
    if a.name == "sft":
        examples = load_sft_examples(split, d.heldout_size, d.dataset, **kw)
        out = [[enc(e.messages, e.response)] for e in examples]
    else:
        pairs = load_preference_pairs(split, d.heldout_size, d.dataset, **kw)
        out = [[enc(p.messages, p.chosen), enc(p.messages, p.rejected)] for p in pairs]
    return out[: d.train_size] if split == "train" else out  # train_size null: every example


def tokenize_steps(d: DataConfig, a: AlgorithmConfig, tokenizer, split: str) -> list[tuple[list[int], int, list[int], list[int]]]:
    """The job's rows from ``data.dataset``'s ``split``: per solution ``(ids, prompt_len,
    step_ends, labels)`` with only its labelled steps' end positions and 0/1 labels (by
    ``algorithm.supervision``; :func:`alignment.data.step_data.encode_steps`, steps ending past
    ``data.max_length`` dropped; the prompt is not cut: ``data.max_prompt_length`` does not apply).
    Solutions without a labelled step within ``data.max_length`` are left out.

    Raises:
        FileNotFoundError, ValueError: as :func:`alignment.data.step_data.load_records`.
    """
    rows = []
    for record in load_records(d.dataset, split):
        labels = supervised_labels(record, a.supervision)
        if not any(y is not None for y in labels):
            continue
        try:
            ids, prompt_len, ends = encode_steps(tokenizer, record.prompt, record.completions, a.step_separator,
                                                 d.max_length)
        except ValueError:  # the prompt leaves no room for a step within data.max_length
            continue
        kept = [(e, int(y)) for e, y in zip(ends, labels) if y is not None]
        if kept:
            rows.append((ids, prompt_len, [e for e, _ in kept], [y for _, y in kept]))
    return rows
