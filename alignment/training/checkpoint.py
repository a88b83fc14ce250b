"""Checkpoints written atomically: into ``<dir>.tmp`` first, renamed into place by rank 0
once every rank has finished, so a crash never leaves a half-written checkpoint where a
reader (or a resume) would take it for a complete one. Each holds ``manifest.json`` (every file
and its size), checked before anything is read (:func:`verify_checkpoint`), so a file cut short
by a copy or a full disk is named instead of half-read; ``common.pt`` is read with
``torch.load(weights_only=True)`` (no arbitrary objects unpickled)."""

from __future__ import annotations

import errno
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from alignment.models.weights import export_hf_weights
from parallel.atomic_dir import MANIFEST, fresh_tmp, publish
from parallel.lora import adapters, signature
from parallel.names import unwrap


class CheckpointError(ValueError):
    """A checkpoint that cannot be read (a file missing or cut short, or not weights only) or
    written (no room on the disk)."""


MIB = 1 << 20


def directory_bytes(path: str | os.PathLike) -> int:
    """The bytes of every file below ``path`` (0 when it does not exist)."""
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())


def free_bytes(path: str | os.PathLike) -> int:
    """Free bytes (for this user) on the filesystem of ``path``, or of its nearest existing parent."""
    p = Path(path).absolute()
    while not p.exists():
        p = p.parent
    return shutil.disk_usage(p).free


def ensure_space(directory: str | os.PathLike, estimate: Callable[[], int], what: str) -> None:
    """Before a save under ``directory``: rank 0 compares the bytes it will take (the newest
    complete checkpoint's size there, else ``estimate()``, e.g. from
    :func:`parallel.memory.checkpoint_bytes`) with the free space; every rank gets its answer.
    Collective.

    Raises:
        CheckpointError: on every rank, when less is free than ``needed``: both in MiB, ``what``
            (the step) named, and what to do; nothing was written.
    """
    answer = [None, 0, 0]
    if dist.get_rank() == 0:
        latest = latest_checkpoint(directory) if Path(directory).is_dir() else None
        answer = [latest, directory_bytes(latest) if latest else estimate(), free_bytes(directory)]
    dist.broadcast_object_list(answer, src=0)
    latest, needed, free = answer
    if free < needed:
        raise CheckpointError(f"{what}: about {needed / MIB:,.1f} MiB needed in {directory}, {free / MIB:,.1f} "
                              "MiB free; make room (trainer.keep_last=N deletes older checkpoints once a newer one "
                              "is complete) or give an output_dir on a larger disk. Nothing was written"
                              + (f"; {latest.name} is complete and the same command resumes from it" if latest
                                 else ""))


def verify_checkpoint(path: str | os.PathLike) -> None:
    """Check a checkpoint directory before reading it: every file its ``manifest.json`` lists is
    there with its size, and ``common.pt`` (Megatron's non-tensor state) loads with
    ``weights_only=True``. A checkpoint written before manifests existed is checked for the latter only.

    Raises:
        CheckpointError: naming the file, what is wrong and what to do.
    """
    path = Path(path)
    fix = (f"delete {path} to resume from the checkpoint before it (or restore the directory from a copy); "
           "the run's other checkpoints are untouched")
    manifest = path / MANIFEST
    if manifest.is_file():
        try:
            files = json.loads(manifest.read_text())["files"]
        except (ValueError, KeyError) as e:
            raise CheckpointError(f"checkpoint {path}: {MANIFEST} is damaged ({e}); {fix}") from e
        for name, size in files.items():
            f = path / name
            if not f.is_file():
                raise CheckpointError(f"checkpoint {path} is incomplete: {name} is missing; {fix}")
            if f.stat().st_size != size:
                raise CheckpointError(f"checkpoint {path} is damaged: {name} has {f.stat().st_size} bytes, {size} "
                                      f"were written (cut short by a copy or a full disk?); {fix}")
    common = path / "common.pt"
    if common.is_file():
        try:
            torch.load(common, map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001 - any failure to read it is the same for the user
            raise CheckpointError(f"checkpoint {path}: common.pt does not load as weights only "
                                  f"({type(e).__name__}: {str(e)[:200]}); it was not written by this code or is "
                                  f"damaged, and is not unpickled; {fix}") from e


#: how the distributed optimizer's state is laid out in a checkpoint (Megatron's sharding types)
DP_RESHARDABLE, FULLY_RESHARDABLE = "dp_reshardable", "fully_reshardable"


def _optimizer_metadata(sharding: str) -> dict:
    # The distributed optimizer's default sharding type needs ShardedTensor.flattened_range,
    # which torch_dist checkpoints refuse. "dp_reshardable" (every save) writes each rank's own
    # slice of every bucket (fp32 master + Adam moments) as a 1-D ShardedTensor, with no gather and
    # no copy, and loads at another data-parallel size; "fully_reshardable" (on demand:
    # trainer.reshard_checkpoint) gathers the state and writes it in model space, one tensor per
    # parameter shaped and sharded as the parameter, so it loads at any TP/PP/EP/DP; the gather
    # peaks at 7.1 GiB for SmolLM2-135M against 4.x GiB (docs/results.md). A MoE model's optimizer
    # is a chain (dense and expert parameters) when EP > 1 and a single one at EP 1; without
    # "chained_optim_avoid_prefix" Megatron names the state "chained_<i>.<name>", so a fully
    # reshardable checkpoint of one would not load into the other (measured: KeyError at EP 1 -> 2).
    return {"distrib_optim_sharding_type": sharding, "chained_optim_avoid_prefix": sharding == FULLY_RESHARDABLE}


def optimizer_sharding(path: str | os.PathLike) -> str:
    """How the checkpoint at ``path`` holds the distributed optimizer's state: :data:`DP_RESHARDABLE`
    (resumes at another data-parallel size only) or :data:`FULLY_RESHARDABLE` (any layout); read
    from its ``common.pt`` (weights only). A checkpoint of several parts (PPO's policy and critic):
    :data:`FULLY_RESHARDABLE` only when every part is. Written before this was recorded:
    :data:`DP_RESHARDABLE`.

    Raises:
        FileNotFoundError: no ``common.pt`` (check with :func:`verify_checkpoint` first).
    """
    path = Path(path)
    parts = [p for p in sorted(path.iterdir()) if (p / "common.pt").is_file()] or [path]
    kinds = {torch.load(p / "common.pt", map_location="cpu", weights_only=True).get("optimizer_sharding",
                                                                                     DP_RESHARDABLE)
             for p in parts}
    return FULLY_RESHARDABLE if kinds == {FULLY_RESHARDABLE} else DP_RESHARDABLE


def _optimizer_kind(optimizer) -> str | None:
    if optimizer is None:
        return None
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    inner = getattr(optimizer, "chained_optimizers", [optimizer])
    return "distributed" if any(isinstance(o, DistributedOptimizer) for o in inner) else "plain"


def _model_parallel_sizes() -> dict[str, int]:
    """The sizes the distributed optimizer's ``dp_reshardable`` state cannot change on resume
    (its buckets are per tensor x pipeline x expert model-parallel rank)."""
    from megatron.core import parallel_state as ps

    return {"tensor_model_parallel_size": ps.get_tensor_model_parallel_world_size(),
            "pipeline_model_parallel_size": ps.get_pipeline_model_parallel_world_size(),
            "expert_model_parallel_size": ps.get_expert_model_parallel_world_size(),
            "expert_tensor_parallel_size": ps.get_expert_tensor_parallel_world_size()}


def _adapters_only(model) -> bool:
    """A LoRA job's model (:mod:`parallel.lora`): its checkpoints hold only what trains."""

    return bool(adapters(model))


def _lora_signature(model) -> dict | None:
    return signature(unwrap(model))


def _trained_entries(model, model_sd: dict) -> dict:
    """The entries of ``model_sd`` whose tensors train (a LoRA job's adapters, and a value model's
    head): the frozen base is the one in ``model.path``, loaded again on resume."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    trained = {id(p) for p in unwrap(model).parameters() if p.requires_grad}
    return {k: v for k, v in model_sd.items()
            if isinstance(v, (ShardedTensor, ShardedTensorFactory)) and id(v.data) in trained}


def _has_stepped(optimizer) -> bool:
    """Whether ``optimizer`` (a Megatron optimizer, or a chain of them) has applied an update: Adam holds state
    only after its first one. Before it (every update so far skipped: a NaN, or RFT accepting no sample) Megatron
    can write its state but not read it back (no moments, and a ``step`` of 0 left out), and it equals a new one:
    its checkpoint holds no optimizer state (``optimizer_stepped`` false) and a resume keeps the new one."""
    return any(len(getattr(sub, "optimizer", sub).state) for sub in getattr(optimizer, "chained_optimizers", [optimizer]))


def _state(model, optimizer, step: int, is_loading: bool, sharding: str = DP_RESHARDABLE,
           stepped: bool = True) -> dict:
    model_sd = unwrap(model).sharded_state_dict()
    adapters_only = _adapters_only(model)
    if adapters_only:
        model_sd = _trained_entries(model, model_sd)
    state = {"model": model_sd, "step": step, "optimizer_kind": _optimizer_kind(optimizer),
             "model_parallel_sizes": _model_parallel_sizes(), "adapters_only": adapters_only,
             "lora": _lora_signature(model), "optimizer_sharding": sharding, "optimizer_stepped": stepped}
    if optimizer is not None and stepped:
        state["optimizer"] = optimizer.sharded_state_dict(model_sd, is_loading=is_loading,
                                                          metadata=_optimizer_metadata(sharding))
    return state


def save_megatron_checkpoint(model: torch.nn.Module, path: str | os.PathLike, optimizer=None, step: int = 0,
                             config: str | None = None, files: dict[str, str] | None = None,
                             sharding: str = DP_RESHARDABLE) -> Path:
    """Megatron distributed checkpoint (``torch_dist`` format): model shards, optionally the
    optimizer state (Adam moments, sharded as the optimizer is) and the step; collective. A LoRA
    job's model (:mod:`parallel.lora`) writes only what trains (adapters, a value model's head)
    and their optimizer state: the frozen base is ``model.path``'s, named in ``config.yaml``.
    The model part loads at another TP/PP layout with ``dist_checkpointing.load``.
    ``config``: the run's resolved config (YAML text), written as ``config.yaml`` inside the
    checkpoint before it is published; ``files``: more text files written beside it (name -> text, e.g.
    ``prompts.json``: what :func:`launchers.input_checks.check_resume` compares); ``sharding``: the
    distributed optimizer's layout in it (:data:`DP_RESHARDABLE`, or :data:`FULLY_RESHARDABLE` to
    resume at any layout)."""
    from megatron.core import dist_checkpointing

    final = Path(path)
    tmp = fresh_tmp(final)
    if dist.get_rank() == 0:
        written = {**({"config.yaml": config} if config is not None else {}), **(files or {})}
        for name, text in written.items():
            (tmp / name).write_text(text)
    try:
        stepped = optimizer is not None and _has_stepped(optimizer)
        dist_checkpointing.save(_state(model, optimizer, step, is_loading=False, sharding=sharding, stepped=stepped),
                                str(tmp))
    except OSError as e:
        if e.errno != errno.ENOSPC:
            raise
        raise CheckpointError(f"saving {final}: the disk is full ({free_bytes(tmp) / MIB:,.1f} MiB free, "
                              f"{directory_bytes(tmp) / MIB:,.1f} MiB written into {tmp.name}); earlier "
                              "checkpoints are intact; make room and run the same command to resume") from e
    publish(tmp, final)
    return final


def load_megatron_checkpoint(model: torch.nn.Module, path: str | os.PathLike, optimizer=None) -> int:
    """Load what :func:`save_megatron_checkpoint` wrote into ``model`` (and ``optimizer``);
    returns the saved step. Collective. The model loads at any layout; the distributed
    optimizer's state at another data-parallel (or context-parallel) size but the same tensor,
    pipeline and expert sizes, or at any layout when saved :data:`FULLY_RESHARDABLE`.

    Raises:
        FileNotFoundError: no checkpoint at ``path``.
        CheckpointError: a file missing or cut short, or ``common.pt`` not weights only
            (:func:`verify_checkpoint`), before anything is read.
        ValueError: the checkpoint's optimizer kind is not this run's, or distributed-optimizer
            state saved at other tensor/pipeline/expert sizes, or adapters-only against a whole
            model (naming both and the fix).
    """
    from megatron.core import dist_checkpointing

    if not (Path(path) / "metadata.json").exists():
        raise FileNotFoundError(f"no Megatron checkpoint at {path} (metadata.json missing)")
    verify_checkpoint(path)
    common = dist_checkpointing.load_common_state_dict(str(path))
    sharding = common.get("optimizer_sharding", DP_RESHARDABLE)
    adapters_only = _adapters_only(model)
    if bool(common.get("adapters_only", False)) != adapters_only:
        held = "only LoRA adapters" if common.get("adapters_only") else "a whole model"
        raise ValueError(f"checkpoint {path} holds {held} but this run {'adapts' if adapters_only else 'trains'} "
                         f"the {'base with LoRA' if adapters_only else 'whole model'}: resume with the model.lora "
                         "settings it was saved with, or start a new output_dir")
    if adapters_only and common.get("lora") != _lora_signature(model):
        raise ValueError(f"checkpoint {path} holds LoRA adapters {common.get('lora')} but this run builds "
                         f"{_lora_signature(model)}: resume with the model.lora rank, alpha and target_modules it was "
                         "saved with, or start a new output_dir")
    if optimizer is not None:
        saved = common.get("optimizer_kind")
        sizes, now = common.get("model_parallel_sizes"), _model_parallel_sizes()
        if saved == "distributed" and sizes is not None and sizes != now and sharding == DP_RESHARDABLE:
            diff = ", ".join(f"{k}={sizes[k]} (now {now[k]})" for k in now if sizes.get(k) != now[k])
            raise ValueError(
                f"checkpoint {path} holds distributed-optimizer state saved at {diff}: it resumes at "
                "another data-parallel size only. Resume with those sizes, or rewrite it for any layout first: "
                "run once at those sizes with trainer.reshard_checkpoint=true (docs/guides/checkpoints.md)")
        if saved != _optimizer_kind(optimizer):
            raise ValueError(
                f"checkpoint {path} holds {saved or 'no'} optimizer state but this run uses the "
                f"{_optimizer_kind(optimizer)} optimizer: resume with trainer.use_distributed_optimizer="
                f"{'true' if saved == 'distributed' else 'false'}, or start a new output_dir")
    stepped = bool(common.get("optimizer_stepped", True))  # False: saved before its first update (_has_stepped)
    loaded = dist_checkpointing.load(_state(model, optimizer, 0, is_loading=True, sharding=sharding, stepped=stepped),
                                     str(path))
    result = unwrap(model).load_state_dict(loaded["model"], strict=not adapters_only)
    if adapters_only:  # the frozen base stays as loaded from model.path; every trained tensor must come back
        trained = {n for n, p in unwrap(model).named_parameters() if p.requires_grad}
        if trained & set(result.missing_keys) or result.unexpected_keys:
            raise ValueError(f"checkpoint {path}: trained tensors missing {sorted(trained & set(result.missing_keys))}"
                             f", unexpected {sorted(result.unexpected_keys)}")
    if optimizer is not None and stepped:
        state = loaded["optimizer"]
        optimizer.load_state_dict(_fit_to_chain(optimizer, state, path) if sharding == FULLY_RESHARDABLE else state)
    return int(loaded["step"])


#: what tells a Megatron param group of the dense optimizer from the expert one's (not its hyperparameters)
_GROUP_PLACE = ("is_expert_parallel",)


def _fit_to_chain(optimizer, state: dict, path) -> dict:
    """A fully reshardable checkpoint's optimizer state in the form ``optimizer`` loads. Megatron
    keeps a MoE model's expert parameters in an optimizer of their own at EP > 1 (a chain of two,
    state ``{0: dense, 1: experts}``) and in the one optimizer at EP 1, where their param groups are
    not marked ``is_expert_parallel``; the tensors are already where ``optimizer`` asked for them
    (``chained_optim_avoid_prefix``), but the param groups (step, learning rate, betas) come in the
    writer's form. Each group takes the hyperparameters of the written group with the same
    ``wd_mult``, ``lr_mult`` and ``is_decoupled_lr``.

    Raises:
        ValueError: a group with no written counterpart (naming the checkpoint).
    """
    subs = list(getattr(optimizer, "chained_optimizers", [optimizer]))
    parts = {k: v for k, v in state.items() if isinstance(k, int)}
    if (len(subs) == 1) == ("optimizer" in state):  # written in this form (one optimizer: its groups on top)
        return state
    written = [g for part in [state, *parts.values()] for g in part.get("optimizer", {}).get("param_groups", [])]
    scaler = next((part["grad_scaler"] for part in [state, *parts.values()] if "grad_scaler" in part), None)

    def key(group: dict) -> tuple:
        return tuple(group.get(k) for k in ("wd_mult", "lr_mult", "is_decoupled_lr"))

    by_key = {key(g): g for g in written}
    fitted = []
    for i, sub in enumerate(subs):
        groups = []
        for group in sub.optimizer.param_groups:
            if key(group) not in by_key:
                raise ValueError(f"checkpoint {path}: no optimizer param group with wd_mult, lr_mult, is_decoupled_lr "
                                 f"= {key(group)} was written; it holds {sorted(by_key)}")
            hyper = {k: v for k, v in by_key[key(group)].items() if k not in _GROUP_PLACE}
            groups.append({**{k: v for k, v in group.items() if k != "params"}, **hyper})
        part = {"optimizer": {"param_groups": groups}, "param_state_sharding_type": FULLY_RESHARDABLE,
                "param_state": (state if len(subs) == 1 else parts[i])["param_state"]}
        if scaler is not None:
            part["grad_scaler"] = scaler
        fitted.append(part)
    return fitted[0] if len(subs) == 1 else dict(enumerate(fitted))


def save_models_checkpoint(directory: str | os.PathLike, step: int, parts: dict, config: str | None = None,
                           files: dict[str, str] | None = None, sharding: str = DP_RESHARDABLE) -> Path:
    """``<directory>/step_<step>`` holding every trained model of a job, published together;
    collective. ``parts``: name -> ``(model, optimizer)``. One part is written as one
    :func:`save_megatron_checkpoint` at the step directory itself (the policy of a GRPO job);
    several go to ``step_<step>/<name>`` (PPO's policy and critic), written into
    ``step_<step>.parts`` first and renamed into place only when all are complete, after which the
    step's ``metadata.json`` marks it complete for :func:`latest_checkpoint`. ``sharding``: as
    :func:`save_megatron_checkpoint`'s."""
    final = Path(directory) / f"step_{step}"
    if len(parts) == 1:
        [(model, optimizer)] = parts.values()
        return save_megatron_checkpoint(model, final, optimizer=optimizer, step=step, config=config, files=files,
                                        sharding=sharding)
    staged = final.with_name(final.name + ".parts")
    for name, (model, optimizer) in parts.items():
        save_megatron_checkpoint(model, staged / name, optimizer=optimizer, step=step, config=config, files=files,
                                 sharding=sharding)
    if dist.get_rank() == 0:  # every part complete: publish them together, then mark the step complete
        shutil.rmtree(final, ignore_errors=True)
        os.replace(staged, final)
        (final / "metadata.json").write_text(json.dumps({"step": step}))
    dist.barrier()
    return final


def load_models_checkpoint(path: str | os.PathLike, parts: dict) -> int:
    """Load what :func:`save_models_checkpoint` wrote into ``parts`` (name -> ``(model,
    optimizer)``, the same names); returns the step. Collective. Raises as
    :func:`load_megatron_checkpoint`."""
    if len(parts) == 1:
        [(model, optimizer)] = parts.values()
        return load_megatron_checkpoint(model, path, optimizer)
    steps = [load_megatron_checkpoint(model, Path(path) / name, opt) for name, (model, opt) in parts.items()]
    return steps[0]


def checkpoint_step(path: str | os.PathLike) -> int | None:
    """N for a published, complete ``step_N`` directory (its ``metadata.json`` written); None for
    anything else, e.g. the ``step_N.tmp`` / ``.parts`` / ``.old`` leftovers of an interrupted save."""
    path = Path(path)
    n = path.name.removeprefix("step_")
    if path.name.startswith("step_") and n.isdigit() and (path / "metadata.json").is_file():
        return int(n)
    return None


def latest_checkpoint(directory: str | os.PathLike) -> Path | None:
    """The complete ``step_N`` checkpoint with the largest N under ``directory`` (leftovers of an
    interrupted save are ignored: :func:`checkpoint_step`), or None."""
    found = [(step, d) for d in Path(directory).glob("step_*") if (step := checkpoint_step(d)) is not None]
    return max(found)[1] if found else None


def prune_checkpoints(directory: str | os.PathLike, keep_last: int) -> list[Path]:
    """Delete all but the newest ``keep_last`` complete checkpoints under ``directory``
    (``trainer.keep_last``), and what interrupted saves of older steps left (``step_N.tmp`` /
    ``.parts`` / ``.old``). Call it after a save is published: a checkpoint goes only once a newer
    one is complete, and each is first renamed out of :func:`latest_checkpoint`'s sight
    (``step_N.deleting``), so a kill while deleting never leaves a half-deleted checkpoint that
    looks complete. Rank 0 only. Returns the paths deleted.

    Raises:
        ValueError: ``keep_last`` < 1.
    """
    if keep_last < 1:
        raise ValueError(f"trainer.keep_last={keep_last}: must be >= 1 (0 keeps every checkpoint: do not prune)")
    found = sorted((step, d) for d in Path(directory).glob("step_*") if (step := checkpoint_step(d)) is not None)
    if not found:
        return []
    newest = found[-1][0]
    doomed = [d for _, d in found[:-keep_last]]
    for d in Path(directory).glob("step_*.*"):  # leftovers: step_N.tmp / .parts / .old / .deleting
        n = d.name.removeprefix("step_").split(".")[0]
        if n.isdigit() and int(n) < newest and d not in doomed:
            doomed.append(d)
    for d in doomed:
        gone = d if d.name.endswith(".deleting") else d.with_name(d.name + ".deleting")
        if gone != d:
            shutil.rmtree(gone, ignore_errors=True)
            os.replace(d, gone)
        shutil.rmtree(gone, ignore_errors=True)
    return doomed


#: a vision-language model's processor files, copied beside the weights of its export
PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json", "video_preprocessor_config.json",
                   "chat_template.json")


def copy_processor_files(src: str | os.PathLike | None, dst: str | os.PathLike) -> None:
    """Copy the :data:`PROCESSOR_FILES` that directory ``src`` has (none when ``src`` is None) into ``dst``."""
    for name in PROCESSOR_FILES if src is not None else ():
        if (Path(src) / name).is_file():
            shutil.copyfile(Path(src) / name, Path(dst) / name)


#: the files of a model's own tokenizer, copied as they are into an export (never a wrapper's re-save: vLLM's
#: cached tokenizer would write its own class name, which transformers cannot load)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "merges.txt", "tokenizer.model", "vocab.txt", "chat_template.jinja")


def copy_tokenizer_files(src: str | os.PathLike | None, dst: str | os.PathLike) -> bool:
    """Copy the :data:`TOKENIZER_FILES` directory ``src`` has into ``dst``; whether it had a tokenizer."""
    found = [Path(src) / n for n in TOKENIZER_FILES if (Path(src) / n).is_file()] if src is not None else []
    for f in found:
        shutil.copyfile(f, Path(dst) / f.name)
    return any(f.name in ("tokenizer.json", "vocab.json", "tokenizer.model", "vocab.txt") for f in found)


def config_with_dtype(hf_config, state: dict[str, torch.Tensor]):
    """A copy of ``hf_config`` whose ``dtype`` is the floating dtype of the exported tensors ``state`` (the
    base model's config may say float32 for bf16 weights, or the other way round)."""
    dtypes = {v.dtype for v in state.values() if v.is_floating_point()}
    out = type(hf_config).from_dict(hf_config.to_dict())
    if len(dtypes) == 1:
        out.dtype = next(iter(dtypes))
    return out


def save_hf_checkpoint(model: torch.nn.Module, bridge, hf_config, tokenizer, path: str | os.PathLike,
                       assets_from: str | os.PathLike | None = None) -> Path:
    """HF directory (``config.json``, ``model.safetensors``, tokenizer) that
    ``transformers.AutoModelForCausalLM.from_pretrained`` (a vision-language model:
    ``AutoModelForImageTextToText``) loads, with the :data:`PROCESSOR_FILES` that ``assets_from`` (the
    base model's directory) has; ``config.json``'s ``dtype`` is the tensors' (:func:`config_with_dtype`), the
    tokenizer the base model's own files (:func:`copy_tokenizer_files`; ``tokenizer`` is saved only without
    them); collective, rank 0 writes."""
    from safetensors.torch import save_file

    final = Path(path)
    tmp = fresh_tmp(final)
    state = export_hf_weights(model, bridge)
    if dist.get_rank() == 0:
        save_file({k: v.contiguous() for k, v in state.items()}, str(tmp / "model.safetensors"),
                  metadata={"format": "pt"})
        config_with_dtype(hf_config, state).save_pretrained(tmp)
        if not copy_tokenizer_files(assets_from, tmp):
            tokenizer.save_pretrained(tmp)
        copy_processor_files(assets_from, tmp)
    publish(tmp, final)
    return final
