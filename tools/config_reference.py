"""The config-field reference (``docs/reference/config-fields.md``), generated from the schema so it
cannot go stale: every field of :class:`alignment.config.JobConfig` with its type, schema default,
range (its field's metadata: :func:`alignment.schema.ranged`), the values the shipped jobs (``configs/*.yaml``) give it
where they differ from the default, and its doc line (the comment beside or above it in its
section's dataclass, beside the feature: ``alignment/<feature>/config.py``).

    python -m tools.config_reference > docs/reference/config-fields.md

``tests/test_docs.py`` keeps the page equal to this output.
"""

from __future__ import annotations

import dataclasses
import inspect
import io
import re
import tokenize
from pathlib import Path

from omegaconf import OmegaConf

from alignment import config as schema
from alignment.algorithms import registry
from alignment.algorithms.config import AlgorithmConfig
from launchers.preflight import compose

ROOT = Path(__file__).resolve().parents[1]
JOBS_DIR = ROOT / "configs"


def field_docs(cls) -> dict[str, str]:
    """``cls``'s fields -> their doc line: the comment at the end of the field's line, else the
    comment lines just above it, joined."""
    source = inspect.getsource(cls)
    docs, above, pending = {}, [], {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            text = tok.string.lstrip("#").strip()
            if tok.line.strip().startswith("#"):
                above.append(text)
            else:  # at the end of a field's line
                name = tok.line.split(":", 1)[0].strip()
                pending[name] = text
        elif tok.type == tokenize.NAME and tok.start[1] == 4 and tok.line[4:].split(":", 1)[0].strip().isidentifier() \
                and re.match(r"    \w+\s*:", tok.line):
            name = tok.string
            if above:
                docs[name] = " ".join(above)
                above = []
        elif tok.type == tokenize.NEWLINE and tok.line.strip().startswith(('"""', "@", "class")):
            above = []
    docs.update(pending)
    return docs


def _default(f: dataclasses.Field):
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None


def _show(value) -> str:
    """A value as YAML writes it, in one line."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, str):
        return repr(value) if value == "" or value.isspace() else value
    if isinstance(value, list):
        return "[" + ", ".join(_show(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_show(v)}" for k, v in value.items()) + "}"
    return repr(value) if isinstance(value, float) else str(value)


def schema_fields(cls=schema.JobConfig, prefix: str = "", own: bool = False):
    """``(dotted name, type, default, doc)`` of every leaf field under ``cls``, in schema order (``own``: only
    the fields ``cls`` declares itself, not those of the classes it derives from)."""
    docs = field_docs(cls)
    hints = {f.name: f for f in dataclasses.fields(cls) if not own or f.name in vars(cls).get("__annotations__", {})}
    for name, f in hints.items():
        value = _default(f)
        if dataclasses.is_dataclass(value):
            yield from schema_fields(type(value), f"{prefix}{name}.")
            continue
        yield f"{prefix}{name}", str(f.type), value, docs.get(name, "")


def section_file(name: str) -> str:
    """The file that declares the section ``name`` of :class:`alignment.config.JobConfig` (relative
    to the repository), e.g. ``alignment/rollout/config.py``."""
    section = next(f for f in dataclasses.fields(schema.JobConfig) if f.name == name)
    cls = AlgorithmConfig if name == "algorithm" else type(_default(section))
    return Path(inspect.getsourcefile(cls)).resolve().relative_to(ROOT).as_posix()


def algorithm_sections() -> list[tuple[type, list[str]]]:
    """Every class of the ``algorithm`` sections that declares keys of its own (from
    :class:`alignment.algorithms.config.AlgorithmConfig` down, base classes first), with the registered
    algorithms whose section has those keys."""
    out = []
    for algorithm in registry.ALGORITHMS.values():
        for cls in reversed(algorithm.config.__mro__):
            if dataclasses.is_dataclass(cls) and cls not in [c for c, _ in out] and \
                    issubclass(cls, AlgorithmConfig) and vars(cls).get("__annotations__"):
                out.append((cls, []))
    for cls, names in out:
        names += [a.name for a in registry.ALGORITHMS.values() if issubclass(a.config, cls)]
    return out


def job_names() -> list[str]:
    """The shipped jobs: ``configs/*.yaml``."""
    return sorted(p.stem for p in JOBS_DIR.glob("*.yaml"))


def job_values() -> dict[str, dict[str, object]]:
    """Job name -> its composed, resolved config as ``{dotted field: value}``."""
    out = {}
    for job in job_names():
        cfg = OmegaConf.to_container(compose(job, []), resolve=True)
        flat = {}

        def walk(node, prefix=""):
            for k, v in node.items():
                if isinstance(v, dict) and not (prefix + k).endswith(("generator_kwargs", "columns",
                                                                       "chat_template_kwargs")):
                    walk(v, f"{prefix}{k}.")
                else:
                    flat[prefix + k] = v
        walk(cfg)
        out[job] = flat
    return out


def page() -> str:
    """The whole Markdown page."""
    jobs = job_values()
    lines = ["# Config fields", "",
             "Every field of the schema (`alignment.config.JobConfig`, its sections in `alignment/<feature>/config.py`),",
             "generated by `python -m tools.config_reference`",
             "(a test keeps this page equal to its output). **Default** is the schema's; **jobs** lists the",
             "shipped jobs (`configs/<job>.yaml`, `--config-name <job>`) that run with another value.",
             "`megalign train --config-name <job> --print-config` prints a job's whole resolved config;",
             "a run writes it to `<output_dir>/config.yaml`.", ""]
    section, field_ranges = None, schema.every_range()
    header = ["| field | type | default | range | jobs | doc |", "|---|---|---|---|---|---|"]
    for name, typ, default, doc in schema_fields():
        top = name.split(".")[0] if "." in name or name == "algorithm" else "(top level)"
        if top != section:
            section = top
            lines += ["", f"## {section}", ""] + ([f"Declared in `{section_file(section)}`.", ""]
                                                    if section != "(top level)" else [])
            lines += header if section != "algorithm" else []
        if name == "algorithm":  # each algorithm's own section
            lines += ["Each algorithm's section has its own keys only: a key of another algorithm's is refused. "
                      "The keys below are grouped by the class that declares them, with the algorithms that have them.",
                      ""]
            for cls, names in algorithm_sections():
                lines += [f"### `{cls.__name__}`: {', '.join(names)}", ""] + header
                lines += [_row(*row, field_ranges, jobs) for row in schema_fields(cls, "algorithm.", own=True)] + [""]
            continue
        lines.append(_row(name, typ, default, doc, field_ranges, jobs))
    return "\n".join(lines) + "\n"


def _row(name: str, typ: str, default, doc: str, field_ranges: dict, jobs: dict) -> str:
    rng = field_ranges[name].describe() + field_ranges[name].note if name in field_ranges else ""
    differ = {}
    for job, values in jobs.items():
        if name in values and values[name] != default and not (name in ("run_name", "output_dir")):
            differ.setdefault(_show(values[name]), []).append(job)
    jobs_cell = "; ".join(f"{', '.join(js)}: `{v}`" for v, js in differ.items())
    cells = [f"`{name}`", typ.replace("Optional[", "null or ").replace("]", "").replace("[", " of "),
             f"`{_show(default)}`", rng, jobs_cell, doc]
    return "| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"


if __name__ == "__main__":
    print(page(), end="")
