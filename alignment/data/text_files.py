"""Reading the text files users and packages give: UTF-8 throughout, a bad byte named by file, line and column
(:func:`check_utf8`, :func:`read_text`), and the one JSON-lines reader every part of megalign uses
(:func:`read_jsonl`: ``data.dataset``'s ``.jsonl``, the PRM's step records, the regression suite, GSM8K), each
record with where it is and each bad line named the same way."""

from __future__ import annotations

import json
from pathlib import Path


def check_utf8(path: str | Path, field: str) -> None:
    """The text file ``path`` (given as the config field ``field``) is UTF-8 throughout, read a line
    at a time.

    Raises:
        ValueError: the first byte that is not UTF-8, named by ``file:line`` and column (Python's
            bare ``UnicodeDecodeError`` names neither) and the fix.
    """
    with open(Path(path).expanduser(), "rb") as f:
        for n, line in enumerate(f, 1):
            try:
                line.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"{field}={path}:{n}: not UTF-8 text (byte 0x{line[e.start]:02x} at column "
                                 f"{e.start + 1}: {e.reason}); save the file as UTF-8") from e


def read_text(path: str | Path, field: str) -> str:
    """The text of the file ``path`` (given as the config field ``field``), decoded as UTF-8.

    Raises:
        ValueError: a byte that is not UTF-8, named by ``file:line`` (:func:`check_utf8`).
    """
    try:
        return Path(path).expanduser().read_text(encoding="utf-8")
    except UnicodeDecodeError:
        check_utf8(path, field)  # names the line
        raise


def read_jsonl(path: str | Path, field: str) -> list[tuple[str, object]]:
    """The records of the JSON-lines file ``path`` (given as ``field``, e.g. ``data.dataset``), blank lines
    skipped, each with where it is: ``(f"{path}:{line}", record)``, lines counted from 1.

    Raises:
        ValueError: a byte that is not UTF-8 (:func:`check_utf8`), or a line that is not JSON, named
            ``{path}:{line}: not a JSON line ({reason} at column {column})``.
    """
    records = []
    for n, line in enumerate(read_text(path, field).splitlines(), 1):
        if not line.strip():
            continue
        try:
            records.append((f"{path}:{n}", json.loads(line)))
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{n}: not a JSON line ({e.msg} at column {e.colno})") from e
    return records
