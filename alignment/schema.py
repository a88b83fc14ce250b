"""The schema's building blocks, below every config section: :class:`ConfigError`, a numeric
field's :class:`Range` in its metadata (:func:`ranged`, :func:`unbounded`), and helpers that walk
sections (:func:`numeric_fields`, :func:`field_ranges`, :func:`plain`, :func:`dotted`).

Each feature declares its own section beside it (``alignment/<feature>/config.py``: the dataclass,
its ranges, and the checks of its own values); :mod:`alignment.config` composes them into the job's
schema and checks what depends on several sections.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from collections.abc import Callable
from typing import Any
from dataclasses import dataclass, field

from omegaconf import OmegaConf


class ConfigError(ValueError):
    """A config value that cannot work; the message names the field and the fix."""


@dataclass(frozen=True)
class Range:
    """A numeric field's valid values: from ``low`` (``low_in``: included) to ``high`` (None: no
    bound above; ``high_in``: included); ``note``: what the value means, put after the range in the
    error and the reference page, e.g. `` (0: never)``."""

    low: float
    high: float | None = None
    low_in: bool = True
    high_in: bool = False
    note: str = ""

    def describe(self) -> str:
        """The range in words, e.g. ``>= 1``, ``in (0, 1]``."""
        if self.high is None:
            return f"{'>=' if self.low_in else '>'} {self.low}"
        return f"in {'[' if self.low_in else '('}{self.low}, {self.high}{']' if self.high_in else ')'}"

    def excludes(self, value) -> bool:
        """Whether ``value`` (a number; None: unset, never excluded) is outside the range (NaN always is)."""
        if value is None or isinstance(value, bool):
            return False
        if isinstance(value, float) and math.isnan(value):
            return True
        below = value < self.low if self.low_in else value <= self.low
        above = self.high is not None and (value > self.high if self.high_in else value >= self.high)
        return below or above


#: a field's metadata key marking a value a shipped job chose for its built-in task (:func:`per_task`)
PER_TASK = "per_task"


def ranged(default: Any, low: float, high: float | None = None, *, low_in: bool = True, high_in: bool = False,
           note: str = "", task: bool = False) -> Any:
    """A numeric schema field with its :class:`Range` in the field's metadata (``"range"``): the one
    place a field's range lives (:func:`alignment.config.validate_ranges` checks it, ``tools/config_reference.py``
    prints it). ``task``: the field is :func:`per_task`."""
    return field(default=default, metadata={"range": Range(low, high, low_in, high_in, note), PER_TASK: task})


def per_task(default: Any) -> Any:
    """A non-numeric schema field whose shipped jobs' values fit their built-in task (``run_name``): a job on
    the user's own data (``data.train_files``, or a data file of an SFT / RM / DPO job) takes the schema's
    ``default`` instead, unless the user sets it (:mod:`alignment.compose`)."""
    return field(default=default, metadata={PER_TASK: True})


def unbounded(default: Any = None, *, factory: Callable[[], Any] | None = None) -> Any:
    """A numeric schema field any value suits (a reward threshold, a bound on a metric) or a list
    checked where it is used: marked so, so that every numeric field says what its values may be."""
    if factory is not None:
        return field(default_factory=factory, metadata={"range": None})
    return field(default=default, metadata={"range": None})


def plain(value: Any) -> Any:
    """A config section or value as plain dicts and lists (JSON-able, picklable): a dataclass via
    ``dataclasses.asdict``, a config node via ``OmegaConf.to_container``."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    return OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value


def dotted(cfg, name: str):
    """The value of the dotted field ``name`` (e.g. ``trainer.lr``) of ``cfg``; None where a part is absent."""
    for part in name.split("."):
        cfg = getattr(cfg, part, None)
    return cfg


def numeric_fields(cls, prefix: str = "") -> dict[str, dataclasses.Field]:
    """Every int / float field (or list of them) of the dataclass schema ``cls`` (e.g. :class:`JobConfig`),
    dotted -> its field, nested dataclasses (and lists of them) included."""
    hints, out = typing.get_type_hints(cls), {}
    for f in dataclasses.fields(cls):
        args = [a for a in typing.get_args(hints[f.name]) if a is not type(None)] or [hints[f.name]]
        if dataclasses.is_dataclass(args[0]):
            out.update(numeric_fields(args[0], prefix + f.name + "."))
        elif len(args) == 1 and args[0] in (int, float):
            out[prefix + f.name] = f
    return out


def field_ranges(cls) -> dict[str, Range]:
    """Dotted field -> its :class:`Range`, for every numeric field of the dataclass schema ``cls``
    that has one (:func:`ranged`)."""
    fields = numeric_fields(cls)
    return {name: f.metadata["range"] for name, f in fields.items() if f.metadata.get("range") is not None}


@dataclass(frozen=True)
class Key:
    """One key of a dataclass schema (:func:`schema_keys`): its Python ``kind`` (``int``, ``float``,
    ``bool``, ``str``, ``list``, ``dict``: free-form below, ``section``: a nested dataclass), whether it
    may be null, the element dataclass of a list of sections (``reward.functions``) and its field (range,
    metadata)."""

    name: str
    kind: str
    nullable: bool
    field: dataclasses.Field | None = None
    item: type | None = None  # a list of dataclasses: the element's schema
    schema: type | None = None  # a section: its dataclass


def _kind(hint) -> tuple[str, bool, type | None, type | None]:
    args = typing.get_args(hint)
    nullable = type(None) in args
    inner = [a for a in args if a is not type(None)]
    if typing.get_origin(hint) is typing.Union and len(inner) == 1:
        hint, args = inner[0], typing.get_args(inner[0])
    if dataclasses.is_dataclass(hint):
        return "section", nullable, None, hint
    origin = typing.get_origin(hint) or hint
    if origin in (list, tuple):
        item = args[0] if args and dataclasses.is_dataclass(args[0]) else None
        return "list", nullable, item, None
    if origin in (int, float, bool, str):
        return origin.__name__, nullable, None, None
    return "dict", True, None, None  # dict[...] / Any: free-form


def schema_keys(cls, prefix: str = "") -> dict[str, Key]:
    """Every key of the dataclass schema ``cls`` (e.g. :class:`alignment.config.JobConfig`), dotted ->
    :class:`Key`: sections and their fields, nested sections included."""
    hints, out = typing.get_type_hints(cls), {}
    for f in dataclasses.fields(cls):
        kind, nullable, item, schema = _kind(hints[f.name])
        name = prefix + f.name
        out[name] = Key(name, kind, nullable, f, item, schema)
        if schema is not None:
            out.update(schema_keys(schema, name + "."))
    return out
