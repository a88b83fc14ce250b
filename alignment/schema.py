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


def ranged(default, low, high=None, *, low_in: bool = True, high_in: bool = False, note: str = ""):
    """A numeric schema field with its :class:`Range` in the field's metadata (``"range"``): the one
    place a field's range lives (:func:`alignment.config.validate_ranges` checks it, ``tools/config_reference.py``
    prints it)."""
    return field(default=default, metadata={"range": Range(low, high, low_in, high_in, note)})


def unbounded(default=None, *, factory=None):
    """A numeric schema field any value suits (a reward threshold, a bound on a metric) or a list
    checked where it is used: marked so, so that every numeric field says what its values may be."""
    if factory is not None:
        return field(default_factory=factory, metadata={"range": None})
    return field(default=default, metadata={"range": None})


def plain(value):
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
