"""Hydra composition of a job's config, as every entry composes it (``megalign train``, the ranks of
``launchers/train.py``, the preflight check, the evaluation suites, the docs tests).

A job is ``<name>.yaml`` in the repository's ``configs/`` or in the user's own folder
(``--config-dir DIR``, searched first; its job may list the shipped groups and jobs in its
``defaults:``), composed with Hydra overrides (``key=value``, ``group=option``, ``+key=value``).
:func:`compose_job` adds to Hydra's composition what makes it strict and honest:

* **Strict keys** (:func:`check_overrides`): a key outside the schema is refused, with or without
  ``+``, naming the nearest valid keys; a value of the wrong type names the expected type and range.
  Hydra's own errors for the user's YAML files are turned into the same lines (:func:`translate`).
* **Who set what**: the keys the user set, on the command line or in their own YAML files
  (:attr:`Composition.user_keys`), apart from what the shipped files set.
* **The user's data, not the demo's defaults**: a job on the user's own data (``data.train_files``;
  an SFT / RM / DPO job's data file) does not take the values a shipped job chose for its built-in
  task (fields marked :func:`alignment.schema.per_task`: ``run_name``, ``trainer.steps``, the rollout
  lengths): they fall back to the schema's general defaults unless the user sets them, and
  :attr:`Composition.left_out` lists them.
* **Derived defaults** (:attr:`Composition.derived`): ``run_name`` from the algorithm and the data,
  ``data.heldout_fraction`` (5 % of the user's prompt files by default), LoRA's learning rate; an agent's
  episodes take their budgets (``rollout.agent_max_tokens``, ``agent_max_tokens_per_turn``).
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass, field
from pathlib import Path

import yaml
from hydra import compose as hydra_compose
from hydra import initialize_config_dir
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from alignment.algorithms import registry
from alignment.config import JobConfig, register
from alignment.data.chat_data import is_data_file
from alignment.envs.factory import HUB_ENVIRONMENTS
from alignment.reads import unread_keys
from alignment.rollout.config import played_by_agents
from alignment.schema import PER_TASK, ConfigError, Key, schema_keys

#: the config groups and jobs (``configs/<name>.yaml``, ``configs/recipes/...``)
CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs"
#: ``data.heldout_fraction`` of the user's prompt files when neither it nor ``data.heldout_files`` is given
DEFAULT_HELDOUT_FRACTION = 0.05
#: Adam's learning rate for LoRA adapters when the user turns LoRA on without giving one (PEFT's and TRL's
#: examples use 1e-4 to 2e-4; full fine-tuning's rates, 1e-6 to 1e-5, barely move adapters that start at 0)
LORA_LR = 1e-4
_KINDS = {"int": "an integer", "float": "a number", "bool": "true or false", "str": "a string",
          "list": "a list [...]", "section": "a mapping {key: value, ...}", "dict": "a mapping"}


@dataclass
class Composition:
    """A composed job: ``cfg`` (Hydra's ``DictConfig``, typed by :class:`alignment.config.JobConfig`),
    the job's ``name`` and ``job_file``, the user's ``config_dir`` (None: the shipped ``configs/``),
    ``overrides`` as given to Hydra, ``user_keys`` (dotted keys the user set), ``left_out`` (key -> the
    shipped value a job on the user's own data did not take) and ``derived`` (key -> the value set here)."""

    cfg: DictConfig
    name: str
    job_file: Path
    config_dir: Path | None = None
    overrides: list[str] = field(default_factory=list)
    user_keys: frozenset[str] = frozenset()
    left_out: dict = field(default_factory=dict)
    derived: dict = field(default_factory=dict)
    resolved: dict = field(default_factory=dict)  # nulls filled as the schema says, not worth a mention
    # algorithm.* keys the shipped files set that the job's algorithm has not (e.g. grpo.yaml's clip_ratio under
    # algorithm.name=rft): key -> value, not taken (the user's own are refused)
    dropped: dict = field(default_factory=dict)

    def set_by_user(self, key: str) -> bool:
        """Whether the user set ``key``, or a section above it, or a key below it."""
        return any(k == key or key.startswith(k + ".") or k.startswith(key + ".") for k in self.user_keys)


def job_keys(algorithm: type | None = None) -> dict[str, Key]:
    """Every key of :class:`alignment.config.JobConfig`, dotted -> :class:`alignment.schema.Key`, with the
    keys of the ``algorithm`` section ``algorithm`` (a class below
    :class:`alignment.algorithms.config.AlgorithmConfig`) when given."""
    keys = schema_keys(JobConfig)
    if algorithm is not None:
        keys.update(schema_keys(algorithm, "algorithm."))
    return keys


def nearest(name: str, keys) -> list[str]:
    """Up to three valid keys closest to the unknown dotted key ``name``: close spellings in its section,
    the same field name in another section, close spellings anywhere."""
    keys = list(keys)
    section, _, leaf = name.rpartition(".")
    same = [k for k in keys if k.rpartition(".")[0] == section]
    close = [f"{section}.{x}" if section else x
             for x in difflib.get_close_matches(leaf, [k.rpartition(".")[2] for k in same], n=3, cutoff=0.6)]
    moved = [k for k in keys if k.rpartition(".")[2] == leaf and k != name]
    anywhere = [] if close or moved else difflib.get_close_matches(name, keys, n=3, cutoff=0.75)
    return list(dict.fromkeys(close + moved + anywhere))[:3]


def unknown_key(name: str, where: str = "") -> ConfigError:
    """The error for a key outside the schema (``where``: the file that sets it)."""
    keys = job_keys()
    for algorithm in registry.ALGORITHMS.values():  # a key of an algorithm's section
        keys.update(schema_keys(algorithm.config, "algorithm."))
    guess = nearest(name, keys)
    hint = f"did you mean {' or '.join(guess)}?" if guess else "megalign train --print-config lists every key"
    return ConfigError(f"{name}{f' (in {where})' if where else ''}: no such key; {hint} (megalign's schema is "
                       "closed: a new key is refused with or without +)")


def _describe(key: Key) -> str:
    rng = key.field.metadata.get("range") if key.field is not None else None
    null = " or null" if key.nullable and key.kind not in ("dict",) else ""
    return _KINDS[key.kind] + (f" {rng.describe()}{rng.note}" if rng is not None else "") + null


def check_value(key: Key, value, given: str) -> None:
    """``value`` (as Hydra parsed it from ``given``) fits ``key``'s type; a mapping's keys, and a list of
    sections' entries' keys, are in the schema.

    Raises:
        ConfigError: naming the key, the expected type and range.
    """
    if isinstance(value, str) and "${" in value:
        return  # an interpolation: checked when resolved
    if value is None:
        if key.nullable or key.kind == "dict":
            return
        raise ConfigError(f"{given}: {key.name} takes {_describe(key)}, not null")
    ok = {"int": isinstance(value, int) and not isinstance(value, bool),
          "float": isinstance(value, (int, float)) and not isinstance(value, bool),
          "bool": isinstance(value, bool), "str": isinstance(value, (str, int, float)) and not isinstance(value, bool),
          "list": isinstance(value, list), "section": isinstance(value, dict), "dict": True}[key.kind]
    if not ok:
        raise ConfigError(f"{given}: {key.name} takes {_describe(key)}, not {value!r}")
    if key.kind == "section":
        _check_mapping(key.name, value, schema_keys(key.schema), given)
    elif key.kind == "list" and key.item is not None:
        for i, entry in enumerate(value):
            if not isinstance(entry, dict):
                raise ConfigError(f"{given}: each entry of {key.name} is a mapping {{key: value, ...}}, entry {i} is "
                                  f"{entry!r}")
            _check_mapping(f"{key.name}[{i}]", entry, schema_keys(key.item), given)


def _check_mapping(name: str, value: dict, keys: dict[str, Key], given: str) -> None:
    for k, v in value.items():
        if k not in keys:
            guess = difflib.get_close_matches(str(k), list(keys), n=3, cutoff=0.6)
            raise ConfigError(f"{given}: {name} has no key {k!r}" + (f"; did you mean {' or '.join(guess)}?" if guess
                                                                       else f"; its keys are {', '.join(keys)}"))
        check_value(Key(f"{name}.{k}", keys[k].kind, keys[k].nullable, keys[k].field, keys[k].item, keys[k].schema),
                    v, given)


def _is_group(key: str, dirs: list[Path]) -> bool:
    return "/" in key or key == "hydra" or any((d / key).is_dir() for d in dirs)


def _free_form(name: str, keys: dict[str, Key]) -> bool:
    """Whether ``name`` lies below a free-form mapping (``data.generator_kwargs.min_terms``)."""
    parts = name.split(".")
    return any(keys.get(".".join(parts[:i])) is not None and keys[".".join(parts[:i])].kind == "dict"
               for i in range(1, len(parts)))


def check_overrides(overrides: list[str], dirs: list[Path] | None = None) -> tuple[list[str], list[str]]:
    """The command line's Hydra ``overrides`` checked against the schema, before Hydra sees them.
    Returns ``(overrides, keys)``: the overrides for Hydra (``+key=value`` on a key the schema has
    becomes ``key=value``: the key exists, nothing is added) and the dotted keys they set.

    Raises:
        ConfigError: a line that is not an override, a key outside the schema (with or without ``+``,
            naming the nearest valid keys) or a value of the wrong type (naming the type and range).
    """
    dirs = dirs or [CONFIG_DIR]
    keys, parser, out, set_keys = job_keys(), OverridesParser.create(), [], []
    for text in overrides:
        try:
            o = parser.parse_overrides([text])[0]
        except HydraException as e:
            raise ConfigError(f"{text!r} is not an override: give key=value (e.g. trainer.lr=1e-6), group=option "
                              f"(e.g. parallel=tp2) or ~group ({str(e).splitlines()[0]})") from None
        name = o.key_or_group
        if o.package is not None or name.split(".")[0] == "hydra" or ("." not in name and _is_group(name, dirs)):
            out.append(text)  # a group choice (data=file, ~demo) or Hydra's own setting
            continue
        if name not in keys:
            if _free_form(name, keys):  # a new or existing key of a free-form mapping: add or change it
                out.append("++" + text.lstrip("+"))
                set_keys.append(name)
                continue
            raise unknown_key(name)
        if not o.is_delete():
            try:
                value = o.value()
            except Exception:  # noqa: BLE001 - a sweep or a function Hydra could not evaluate
                value = text.partition("=")[2]
            check_value(keys[name], value, text)
        out.append(text.lstrip("+") if o.is_add() or o.is_force_add() else text)
        set_keys.append(name)
    return out, set_keys


_HYDRA_KEY = re.compile(r"Key '([^']+)' not in '(\w+)'\s+full_key: (\S+)", re.S)
_HYDRA_VALUE = re.compile(r"Value '(.*?)' (?:of type '\w+' )?could not be converted to (\w+)\s+full_key: (\S+)", re.S)
_HYDRA_IN = re.compile(r"^In '([^']+)'")


def translate(e: Exception, dirs: list[Path]) -> Exception:
    """Hydra's composition error ``e`` as a :class:`alignment.schema.ConfigError` naming the key, the file
    and the fix (an unknown key in a YAML file: the nearest valid keys; a value of the wrong type: the
    expected type), or ``e`` itself when it is neither."""
    text = str(e)
    where = _HYDRA_IN.search(text)
    source = ""
    if where:
        found = [d / f"{where.group(1)}.yaml" for d in dirs if (d / f"{where.group(1)}.yaml").is_file()]
        source = str(found[0]) if found else f"{where.group(1)}.yaml"
    m = _HYDRA_KEY.search(text)
    if m:
        return unknown_key(m.group(3), source)
    m = _HYDRA_VALUE.search(text)
    if m:
        key = job_keys().get(m.group(3))
        expected = _describe(key) if key is not None else m.group(2).lower()
        return ConfigError(f"{m.group(3)}={m.group(1)}{f' (in {source})' if source else ''}: {m.group(3)} takes "
                           f"{expected}")
    return e


def split_job_args(args: list[str]) -> tuple[str, str | None, list[str]]:
    """Hydra's job options out of a command line: ``--config-name NAME`` / ``--config-name=NAME`` /
    ``-cn NAME`` (default ``grpo``), ``--config-dir DIR`` / ``-cd DIR``; returns ``(name, config_dir,
    overrides)``.

    Raises:
        ConfigError: an option without its value, or another option.
    """
    name, config_dir, overrides, rest = "grpo", None, [], list(args)
    options = {"--config-name": "name", "-cn": "name", "--config-dir": "dir", "-cd": "dir"}
    while rest:
        a = rest.pop(0)
        option, eq, value = a.partition("=")
        if option in options and (eq or rest):
            value = value if eq else rest.pop(0)
            if options[option] == "name":
                name = value
            else:
                config_dir = value
        elif option in options:
            raise ConfigError(f"{a} needs a value: --config-name JOB (a shipped job: grpo, sft, rm, dpo, ppo, ...; or "
                              "JOB.yaml in --config-dir DIR)")
        elif a.startswith("-"):
            raise ConfigError(f"unknown option {a!r}: megalign train takes --nproc, --nnodes, --dry-run, "
                              "--print-config, --debug, --config-name, --config-dir and key=value overrides")
        else:
            overrides.append(a)
    return name.removesuffix(".yaml"), config_dir, overrides


def job_file(name: str, dirs: list[Path]) -> Path:
    """The YAML file of the job ``name`` (the first of ``dirs`` that has ``<name>.yaml``).

    Raises:
        ConfigError: no such job, naming the folders searched and the shipped jobs.
    """
    for d in dirs:
        if (d / f"{name}.yaml").is_file():
            return d / f"{name}.yaml"
    shipped = sorted(p.stem for p in CONFIG_DIR.glob("*.yaml"))
    raise ConfigError(f"--config-name {name}: no {name}.yaml in {' or '.join(str(d) for d in dirs)}; the shipped "
                      f"jobs are {', '.join(shipped)} (your own: --config-dir DIR --config-name JOB for DIR/JOB.yaml)")


def _flatten(value, prefix: str) -> list[str]:
    if isinstance(value, dict) and value:
        return [k for key, v in value.items() for k in _flatten(v, f"{prefix}.{key}" if prefix else str(key))]
    return [prefix] if prefix else []


def _file_keys(path: Path, package: str, user_dir: Path, seen: set) -> list[str]:
    """Dotted keys a YAML file of the user's (and the files of theirs its ``defaults:`` list names) sets."""
    if path in seen or not path.is_file():
        return []
    seen.add(path)
    text = path.read_text()
    data = yaml.safe_load(text) or {}
    if not isinstance(data, dict):
        return []
    header = re.search(r"^#\s*@package\s+(\S+)", text, re.M)
    package = "" if header and header.group(1) == "_global_" else (header.group(1) if header else package)
    out = _flatten({k: v for k, v in data.items() if k not in ("defaults", "hydra")}, package)
    for entry in data.get("defaults") or []:
        if isinstance(entry, str) and entry not in ("_self_",):
            out += _file_keys(user_dir / f"{entry.lstrip('/')}.yaml", "", user_dir, seen)
        elif isinstance(entry, dict):
            for group, option in entry.items():
                group = str(group).removeprefix("override ").strip().lstrip("/")
                if isinstance(option, str) and not group.startswith("hydra"):
                    out += _file_keys(user_dir / group / f"{option}.yaml", group.replace("/", "."), user_dir, seen)
    return out


def own_data(cfg) -> bool:
    """Whether the job trains on the user's own data: prompt files (``data.train_files``), an environment hub's
    environment (``rollout.environment=verifiers`` / ``openenv``), or an SFT / RM / DPO data file (``data.dataset``)."""
    d = cfg.data
    return bool(d.train_files) or (registry.get(cfg.algorithm.name).online
                                   and cfg.rollout.environment in HUB_ENVIRONMENTS) or \
        (registry.of(cfg).examples in ("sft", "preference") and is_data_file(str(d.dataset)))


def _data_name(cfg) -> str:
    d = cfg.data
    if d.train_files:
        first = d.train_files if isinstance(d.train_files, str) else list(d.train_files)[0]
        name = Path(str(first)).expanduser().name
        name = name.split(".")[0] if not Path(str(first)).expanduser().is_dir() else name
    elif registry.get(cfg.algorithm.name).online and cfg.rollout.environment in HUB_ENVIRONMENTS:
        name = str(cfg.rollout.environment_id).split(".")[-1].split("/")[-1]
    elif not registry.get(cfg.algorithm.name).online:
        path = Path(str(d.dataset)).expanduser()
        name = path.name.split(".")[0] if not path.is_dir() else path.name
    else:
        name = str(d.task)
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name) or "data"


def _defaults(comp: Composition) -> None:
    """The job's data decides: per-task values left out (:func:`own_data`), then the derived defaults."""
    cfg = comp.cfg
    if own_data(cfg):
        schema = OmegaConf.to_container(OmegaConf.structured(JobConfig), resolve=False)  # interpolations kept
        for name, key in job_keys().items():
            if key.field is None or not key.field.metadata.get(PER_TASK) or comp.set_by_user(name):
                continue
            default = schema
            for part in name.split("."):
                default = default[part]
            now = OmegaConf.select(cfg, name)
            if now != OmegaConf.select(OmegaConf.create(schema), name):
                comp.left_out[name] = now
                OmegaConf.update(cfg, name, default, merge=False)
    if cfg.run_name is None:
        cfg.run_name = comp.derived["run_name"] = f"{registry.get(cfg.algorithm.name).name}_{_data_name(cfg)}"
    if cfg.data.heldout_fraction is None:
        own_prompts = bool(cfg.data.train_files) and not cfg.data.heldout_files
        cfg.data.heldout_fraction = DEFAULT_HELDOUT_FRACTION if own_prompts else 0.0
        (comp.derived if own_prompts else comp.resolved)["data.heldout_fraction"] = cfg.data.heldout_fraction
    r = cfg.rollout
    if played_by_agents(r) and min(r.agent_max_tokens, r.agent_max_tokens_per_turn) >= 1:  # else: a range
        # error names them; an agent's episode has budgets of its own, not one answer's
        budget, turn = r.agent_max_tokens, min(r.agent_max_tokens_per_turn, r.agent_max_tokens)
        context = r.max_model_len if comp.set_by_user("rollout.max_model_len") else None  # null: fit the budget
        for key, value in (("max_tokens", budget), ("eval_max_tokens", budget), ("max_tokens_per_turn", turn),
                           ("max_model_len", context)):
            OmegaConf.update(cfg, f"rollout.{key}", value, merge=False)
            comp.resolved[f"rollout.{key}"] = value
    if cfg.model.lora.rank and comp.set_by_user("model.lora.rank") and not comp.set_by_user("trainer.lr"):
        cfg.trainer.lr = comp.derived["trainer.lr"] = LORA_LR


def compose_job(config_name: str, overrides: list[str], config_dir: str | Path | None = None) -> Composition:
    """The job ``config_name`` (``configs/<name>.yaml``, or ``<config_dir>/<name>.yaml`` first) composed
    with the Hydra ``overrides``, checked strictly and given the defaults of its data (module docstring).

    Raises:
        ConfigError: no such job or folder, a key outside the schema, a value of the wrong type (on the
            command line or in a YAML file), a job whose defaults do not start from the schema.
        hydra.errors.*Exception: what Hydra refuses otherwise (an unknown group option, names them all).
    """
    register()
    dirs = [CONFIG_DIR]
    user_dir = None
    if config_dir is not None:
        user_dir = Path(config_dir).expanduser().resolve()
        if not user_dir.is_dir():
            raise ConfigError(f"--config-dir {config_dir}: no such directory")
        dirs.insert(0, user_dir)
    name = str(config_name).removesuffix(".yaml")
    path = job_file(name, dirs)
    hydra_overrides, keys = check_overrides(list(overrides), dirs)
    search = [f"hydra.searchpath=[file://{CONFIG_DIR}]"] if user_dir is not None else []
    with initialize_config_dir(config_dir=str(dirs[0]), version_base=None):
        try:
            cfg = hydra_compose(name, overrides=hydra_overrides + search)
        except (HydraException, OmegaConfBaseException) as e:
            raise translate(e, dirs) from e
    if OmegaConf.get_type(cfg) is not JobConfig:
        raise ConfigError(f"{path}: its defaults list does not start from megalign's schema; begin it with "
                          "`- job_schema` (then the groups, e.g. `- model: smollm2`), or with a shipped job (`- grpo`)")
    if user_dir is not None and path.parent == user_dir:
        keys += _file_keys(path, "", user_dir, set())
    comp = Composition(cfg, name, path, user_dir, hydra_overrides, frozenset(keys))
    type_algorithm(comp)
    check_read(comp)  # on the values as the user gave them
    _defaults(comp)
    return comp


def _owners(key: str) -> list[str]:
    """The registered algorithms whose section has the top-level key ``key``."""
    return [a.name for a in registry.ALGORITHMS.values() if key in schema_keys(a.config)]


def type_algorithm(comp: Composition) -> None:
    """The composed ``algorithm`` mapping typed by its algorithm's section (the record's ``config``:
    :mod:`alignment.algorithms.registry`): each key checked against that section, values against their
    types. A key the section has not is refused when the user set it, naming whose key it is; one a shipped
    file set is left out (:attr:`Composition.dropped`).

    Raises:
        ConfigError: an unknown ``algorithm.name`` (with the valid ones), a key of another algorithm's
            section or of none (with the nearest of this one's), a value of the wrong type.
    """
    cfg = comp.cfg
    given = OmegaConf.to_container(cfg.algorithm, resolve=False)
    name = str(given.get("name", "grpo"))
    section = registry.get(name).config
    keys = schema_keys(section)
    kept = {}
    for k, v in given.items():
        key = f"algorithm.{k}"
        shown = f"{key}={v}" if not isinstance(v, (dict, list)) and v is not None else key
        if k not in keys:
            if not comp.set_by_user(key):
                comp.dropped[key] = v
                continue
            owners = _owners(k)
            if owners:
                raise ConfigError(f"{shown} is set, but algorithm.name={name} has no such setting (it belongs to "
                                  f"{', '.join(owners)}): remove it")
            guess = nearest(key, [f"algorithm.{x}" for x in keys])
            hint = f"did you mean {' or '.join(guess)}?" if guess else f"its keys are {', '.join(keys)}"
            raise ConfigError(f"{key}: algorithm.name={name} has no such key; {hint}")
        k_ = keys[k]
        check_value(Key(key, k_.kind, k_.nullable, k_.field, k_.item, k_.schema), v, shown)
        kept[k] = v
    cfg.algorithm = OmegaConf.merge(OmegaConf.structured(section), kept)


def check_read(comp: Composition) -> None:
    """Every key the user set is one the job reads (:mod:`alignment.reads`); what the shipped files set and
    the job does not read stays quiet.

    Raises:
        ConfigError: the first key the user set that the job does not read, naming who reads it.
    """
    unread = unread_keys(comp.cfg, sorted(comp.user_keys))
    if unread:
        key, why = next(iter(unread.items()))
        value = OmegaConf.select(comp.cfg, key, default=None)
        shown = "" if isinstance(value, (DictConfig, ListConfig)) or value is None else \
            "=" + (str(value).lower() if isinstance(value, bool) else str(value))
        raise ConfigError(f"{key}{shown} is set, but {why}: it would change nothing; remove it"
                          + (f" (also not read: {', '.join(list(unread)[1:])})" if len(unread) > 1 else ""))


def compose(config_name: str, overrides: list[str], config_dir: str | Path | None = None) -> DictConfig:
    """``configs/<config_name>.yaml`` (or the user's ``config_dir``'s) composed with the Hydra ``overrides``
    (``key=value``, ``group=option``, ``+key=value``), the schema's types and the data's defaults applied:
    :func:`compose_job`'s ``cfg``.

    Raises:
        ConfigError, hydra.errors.*Exception: as :func:`compose_job`.
    """
    return compose_job(config_name, overrides, config_dir).cfg
