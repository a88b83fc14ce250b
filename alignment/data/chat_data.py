"""An SFT, reward-model or DPO job's examples: the demo sets shipped inside a PyPI package or a file of the
user's (its records' layouts: :mod:`alignment.data.records`), split, and tokenised.

The only real chat datasets reachable offline are the demo sets in the ``llamafactory``
source distribution: ``data/alpaca_en_demo.json`` (999 instruction/response pairs) and
``data/dpo_en_demo.json`` (300 preference pairs, possibly multi-turn prompts). The sdist
is fetched once with ``pip download`` into ``$MEGALIGN_CACHE/data`` (default
``~/.cache/megalign/data``) and the JSON files are extracted from it.

Splits are deterministic: records whose prompt repeats an earlier one are dropped (both
demo sets contain exact duplicates: 5 of 300 pairs, 14 of 999 SFT records), then the LAST
``heldout_size`` records are held out and the rest are training records, so no held-out
prompt is ever trained on.
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys
import tarfile
from collections.abc import Mapping
from dataclasses import replace

from filelock import FileLock

from alignment.cache import cache_root
from alignment.data.records import (PreferencePair, SFTExample, UnpairedExample, fields_read, is_unpaired, map_columns,
                                    preference_pair, sft_example, unpaired_example)
from alignment.data.images import resolve
from alignment.data.prompt_data import is_heldout, read_table
from alignment.data.text_files import read_jsonl, read_text

LLAMAFACTORY_VERSION = "0.9.5"
DATASETS = {"alpaca_en_demo": "sft", "dpo_en_demo": "preference"}


def _cache_dir() -> pathlib.Path:
    path = cache_root() / "data"
    path.mkdir(parents=True, exist_ok=True)
    return path


def dataset_path(name: str) -> pathlib.Path:
    """Local path of ``data/<name>.json`` from the llamafactory sdist, fetching it once.

    Raises:
        ValueError: ``name`` not in :data:`DATASETS`.
        RuntimeError: ``pip download`` failed (no access to PyPI); the message has the command.
    """
    if name not in DATASETS:
        raise ValueError(f"data.dataset={name!r}: valid values are {', '.join(DATASETS)}")
    cache = _cache_dir()
    target = cache / f"{name}.json"
    with FileLock(str(cache / ".llamafactory.lock")):
        if target.is_file():
            return target
        sdist = cache / f"llamafactory-{LLAMAFACTORY_VERSION}.tar.gz"
        if not sdist.is_file():
            cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                   f"llamafactory=={LLAMAFACTORY_VERSION}", "-d", str(cache)]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode != 0 or not sdist.is_file():
                raise RuntimeError(f"could not fetch the llamafactory sdist ({' '.join(cmd)}):\n{proc.stderr[-2000:]}")
        with tarfile.open(sdist) as tar:
            member = tar.getmember(f"llamafactory-{LLAMAFACTORY_VERSION}/data/{name}.json")
            data = tar.extractfile(member).read()
        tmp = target.with_suffix(".tmp")
        tmp.write_bytes(data)
        tmp.replace(target)  # atomic: a reader never sees half a file
    return target


def image_files(example) -> list[str]:
    """An example's (:mod:`alignment.data.records`) image files as paths to open."""
    return [resolve(p, pathlib.Path(example.base)) for p in example.images]


def _dedup(items: list, key) -> list:
    seen, out = set(), []
    for item in items:
        k = key(item)
        if k not in seen:
            seen.add(k)
            out.append(item)
    return out


def _split(records: list, split: str, heldout_size: int) -> list:
    if split not in ("train", "heldout"):
        raise ValueError(f"split={split!r}: valid values are train, heldout")
    if not 0 < heldout_size < len(records):
        raise ValueError(f"data.heldout_size={heldout_size}: must be in [1, {len(records) - 1}] (the dataset has "
                         f"{len(records)} distinct records)")
    return records[:-heldout_size] if split == "train" else records[-heldout_size:]


#: what ``datasets`` reads for ``data.dataset`` besides JSON: columnar files and ``save_to_disk`` directories
TABLE_SUFFIXES = (".parquet", ".csv")


def is_data_file(name: str) -> bool:
    """Whether ``data.dataset`` names data of the user's (a ``.json`` / ``.jsonl`` / ``.parquet`` /
    ``.csv`` file or a ``Dataset.save_to_disk`` directory), not a demo set."""
    return str(name).endswith((".json", ".jsonl") + TABLE_SUFFIXES) or pathlib.Path(name).expanduser().is_dir()


def read_records(name: str) -> list[tuple[str, dict]]:
    """``data.dataset``'s records, each with where it is (``file:line`` of a ``.jsonl`` line, ``file
    record N`` of a ``.json`` array, ``path row N`` of a Parquet / CSV file or a ``save_to_disk``
    directory, read with ``datasets``): a demo set of :data:`DATASETS` or a user's data.

    Raises:
        FileNotFoundError: no such file (naming ``data.dataset``).
        ValueError: a line or file that is not JSON, a record that is not an object, or no records.
    """
    if not is_data_file(name):
        path = dataset_path(name)
    elif str(name).endswith(TABLE_SUFFIXES) or pathlib.Path(name).expanduser().is_dir():
        table = read_table(str(name), "data.dataset")
        if str(name).endswith(".csv"):  # CSV has no types: a column of numbers is text there
            return [(f"{name} row {i}", {k: str(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else v
                                         for k, v in r.items()}) for i, r in enumerate(table)]
        return [(f"{name} row {i}", dict(r)) for i, r in enumerate(table)]
    else:
        path = pathlib.Path(name).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"data.dataset={name}: no such file (a .json array or .jsonl lines of records)")
    if path.suffix == ".jsonl":
        records = read_jsonl(path, "data.dataset")
    else:
        text = read_text(path, "data.dataset")
        try:
            data = json.loads(text) if text.strip() else []
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not JSON ({e.msg} at line {e.lineno}); a .json file holds one array of "
                             "records, a .jsonl file one record per line") from e
        if not isinstance(data, list):
            raise ValueError(f"{path}: a .json dataset is an array of records, not a {type(data).__name__}")
        records = [(f"{path} record {i}", r) for i, r in enumerate(data, 1)]
    if not records:
        raise ValueError(f"data.dataset={name}: {path} holds no records")
    for where, r in records:
        if not isinstance(r, dict):
            raise ValueError(f"{where}: a record is a JSON object, not {type(r).__name__}")
    return records


def _key(messages) -> str:
    return json.dumps([[m["role"], m["content"]] for m in messages])


def _prompt_key(e) -> str:
    """An example's prompt identity, which the held-out split follows: its messages, and its image files when
    it has any (one question asked of many images is many examples); a plain text example's text."""
    if not e.messages:
        return "text:" + e.response
    return _key(e.messages) + (json.dumps(list(e.images)) if e.images else "")


def _example_key(e) -> str:
    """What makes two examples the same (repeats are dropped): the prompt (:func:`_prompt_key`); an unpaired
    example's completion and label too (KTO data holds several labelled answers to one prompt)."""
    if isinstance(e, UnpairedExample):
        return _prompt_key(e) + json.dumps([e.completion, e.label])
    return _prompt_key(e)


def unused_columns(name: str, columns: dict | None, kind: str) -> tuple[str, ...]:
    """The columns of ``data.dataset``'s first record that its layout does not read (``kind``: ``sft`` |
    ``preference``; :func:`alignment.data.records.fields_read`), for the start-up summary."""
    where, first = read_records(name)[0]
    mapped = map_columns(where, first, dict(columns or {}), kind)
    return tuple(sorted(set(mapped) - fields_read(mapped, kind)))


def _records(name: str, columns: dict | None, kind: str, parse) -> list:
    """The records of ``name`` parsed; image paths are relative to the data file's folder (``base``)."""
    columns = dict(columns or {})
    base = pathlib.Path(name).expanduser()
    base = base if base.is_dir() else base.parent
    out = [parse(where, map_columns(where, r, columns, kind)) for where, r in read_records(name)]
    return [replace(e, base=str(base)) if e.images else e for e in out]


def split_examples(items: list, split: str, heldout_size: int, heldout: list | None = None,
                   heldout_fraction: float = 0.0) -> list:
    """One split of examples (each with ``messages``), repeats dropped: held out are ``heldout``
    (another file's examples; the training split then leaves out their prompts), else the examples
    whose prompt hashes into ``heldout_fraction`` (:func:`alignment.data.prompt_data.is_heldout`: the
    same for every seed), else the last ``heldout_size``.

    Raises:
        ValueError: an unknown split, or a held-out size the data cannot give.
    """
    if split not in ("train", "heldout"):
        raise ValueError(f"split={split!r}: valid values are train, heldout")
    items = _dedup(items, _example_key)
    if heldout is not None:
        held = _dedup(heldout, _example_key)
        keys = {_prompt_key(e) for e in held}
        return [e for e in items if _prompt_key(e) not in keys] if split == "train" else held
    if heldout_fraction > 0:
        return [e for e in items if is_heldout(_prompt_key(e), heldout_fraction) == (split == "heldout")]
    return _split(items, split, heldout_size)


def load_sft_examples(split: str, heldout_size: int = 100, name: str = "alpaca_en_demo", *,
                      heldout_files=None, heldout_fraction: float = 0.0, columns: dict | None = None) -> list[SFTExample]:
    """SFT examples of one split from ``name`` (:func:`read_records`: a demo set or a user's file;
    alpaca, chat messages or TRL's prompt-completion and text records, :func:`alignment.data.records.sft_example`,
    with ``columns`` renamed by :func:`alignment.data.records.map_columns`), split by :func:`split_examples`
    (``heldout_files``: a path or a list).

    Raises:
        FileNotFoundError, ValueError: as :func:`read_records`; a record without its fields (named
            with its place); a held-out size the data cannot give.
    """
    held = None if not heldout_files else [x for f in _paths(heldout_files) for x in _records(f, columns, "sft", sft_example)]
    return split_examples(_records(name, columns, "sft", sft_example), split, heldout_size, held, heldout_fraction)


def load_preference_pairs(split: str, heldout_size: int = 50, name: str = "dpo_en_demo", *,
                          heldout_files=None, heldout_fraction: float = 0.0,
                          columns: dict | None = None) -> list[PreferencePair] | list[UnpairedExample]:
    """Preference examples of one split from ``name`` (:func:`read_records`; ShareGPT or TRL's records with an
    explicit or implicit prompt, :func:`alignment.data.records.preference_pair`; or, when the first record is
    TRL's unpaired kind, a ``label`` and no ``chosen``, every record unpaired:
    :func:`alignment.data.records.unpaired_example`). Arguments and errors as :func:`load_sft_examples`."""
    kinds: list[str] = []  # the first record's kind: every record's

    def parse(where: str, r: dict):
        kind = "unpaired" if is_unpaired(r) else "paired"
        kinds.append(kind) if not kinds else None
        if kind != kinds[0]:
            raise ValueError(f"{where}: a {kind} preference record among {kinds[0]} ones; give one kind per file "
                             "(chosen / rejected pairs, or completions with a label)")
        return unpaired_example(where, r) if kind == "unpaired" else preference_pair(where, r)

    held = None if not heldout_files else [x for f in _paths(heldout_files) for x in _records(f, columns, "preference", parse)]
    return split_examples(_records(name, columns, "preference", parse), split, heldout_size, held, heldout_fraction)


def _paths(value) -> list[str]:
    return [value] if isinstance(value, str) else [str(v) for v in value]


def _ids(out) -> list[int]:
    if isinstance(out, Mapping) or hasattr(out, "keys"):
        out = out["input_ids"]
    if hasattr(out, "tolist"):
        out = out.tolist()
    if out and isinstance(out[0], (list, tuple)):
        out = out[0]
    return [int(t) for t in out]


def encode_prompt(tokenizer, messages, **template_kwargs) -> list[int]:
    """Chat-template token ids of ``messages`` ending with the assistant generation prefix
    (``template_kwargs``: passed to ``apply_chat_template``, e.g. ``enable_thinking=False``)."""
    return _ids(tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=True,
                                              **template_kwargs))


def encode_example(tokenizer, messages, response: str, max_length: int,
                   max_prompt_length: int | None = None) -> tuple[list[int], int]:
    """Token ids of prompt + response (closed by the end-of-turn token) and the prompt length.

    The response tokens are what the chat template renders for an assistant turn, cut
    after the tokenizer's ``eos_token`` (``<|im_end|>`` for SmolLM2), i.e. exactly what
    a sampler that stops at EOS produces. Truncation (as TRL's ``keep_end`` for the
    prompt): the prompt keeps its LAST ``max_prompt_length`` tokens (default
    ``max_length // 2``), then the response is cut to fit ``max_length``.

    Returns:
        ``(ids, prompt_len)`` with ``len(ids) <= max_length`` and ``0 < prompt_len < len(ids)``.
    Raises:
        ValueError: the template does not render the prompt as a prefix of the full
        conversation, or ``max_length < 2``.
    """
    if max_length < 2:
        raise ValueError(f"data.max_length={max_length}: must be >= 2")
    prompt = encode_prompt(tokenizer, messages)
    full = _ids(tokenizer.apply_chat_template(
        list(messages) + [{"role": "assistant", "content": response}], tokenize=True))
    if full[: len(prompt)] != prompt:
        raise ValueError("the chat template does not render the prompt as a prefix of prompt + response")
    resp = full[len(prompt):]
    eos = tokenizer.eos_token_id
    if eos is not None and eos in resp:
        resp = resp[: resp.index(eos) + 1]
    max_prompt = max_prompt_length if max_prompt_length is not None else max_length // 2
    prompt = prompt[-max_prompt:]
    resp = resp[: max_length - len(prompt)]
    if not resp:
        raise ValueError(f"data.max_length={max_length} leaves no room for the response")
    return prompt + resp, len(prompt)
