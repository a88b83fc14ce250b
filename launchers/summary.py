"""The start-up summary a job prints before it trains, and ``megalign train --dry-run`` prints without
starting a rank: what was composed (what the shipped job files set, what a job on the user's own data
did not take from the demo, what was derived), the data, the reward functions and their conventions,
the steps and lengths, resume or fresh start, and the memory plan."""

from __future__ import annotations

import inspect
import os
from pathlib import Path

from omegaconf import OmegaConf

from alignment.compose import CONFIG_DIR, Composition, job_keys
from alignment.algorithms import registry
from alignment.config import JobConfig, algorithm_section, total_steps
from alignment.rewards.policy import reward_terms
from alignment.models.families import text_config
from alignment.reads import unread_keys
from alignment.rewards.functions import MODEL_FUNCTIONS, TRL, is_user_function, load_user_function
from alignment.rewards.graders import GRADERS
from alignment.envs.factory import HUB_ENVIRONMENTS
from alignment.rollout.agents.hubs import hub_line

#: reward functions named by a word, in words
BUILT_IN = {"correctness": "the task's grader", "format": "the answer's format", "length": "-tokens / max_tokens",
            "environment": "the episode's environment rewards", "reward_model": "model.reward_model_path's score",
            "process_reward": "reward.process_reward_model's step scores", "http": "a reward server",
            "judge": "an LLM judge"}


def _leaves(value, prefix: str = "") -> dict:
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            out.update(_leaves(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    return {prefix: value}


def _show(value) -> str:
    return OmegaConf.to_yaml(OmegaConf.create({"v": value})).strip()[3:] if isinstance(value, (list, dict)) \
        else str(value)


def shipped_values(comp: Composition, unread=()) -> dict:
    """The values the job takes from the shipped job files and groups: every setting that differs from the
    schema's default and that the user did not set (nor was left out or derived here), except the keys in
    ``unread`` (the job does not read them). Dotted key -> resolved value."""
    raw = _leaves(OmegaConf.to_container(comp.cfg, resolve=False))
    resolved = _leaves(OmegaConf.to_container(comp.cfg, resolve=True))
    schema = _leaves(OmegaConf.to_container(OmegaConf.structured(JobConfig), resolve=False))
    schema.update(_leaves({"algorithm": OmegaConf.to_container(OmegaConf.structured(algorithm_section(comp.cfg)))}))
    skip = set(comp.left_out) | set(comp.derived) | set(comp.resolved) | set(unread)
    return {k: resolved[k] for k, v in raw.items() if k in schema and v != schema[k] and k not in skip
            and not comp.set_by_user(k) and not any(k.startswith(u + ".") for u in unread)}


def _source(comp: Composition) -> str:
    path = comp.job_file
    try:
        return f"configs/{path.relative_to(CONFIG_DIR)}"
    except ValueError:
        return str(path)


def composition_lines(comp: Composition, unread=()) -> list[str]:
    """What the job took from where: the left-out demo values, the derived ones, the shipped ones."""
    cfg, lines = comp.cfg, []
    if comp.left_out:
        now = {k: OmegaConf.select(cfg, k) for k in comp.left_out}
        lines.append("your own data, so not the demo's values (set them to keep them): " + ", ".join(
            f"{k}={_show(v)} -> {_show(now[k]) if now[k] is not None else 'null'}" for k, v in comp.left_out.items()))
    why = {"run_name": "from the algorithm and the data",
           "data.heldout_fraction": "of your prompts held out by prompt hash; 0 trains on all",
           "trainer.lr": "LoRA's default rate; the job's was full fine-tuning's"}
    if comp.derived:
        lines.append("derived: " + ", ".join(f"{k}={_show(v)} ({why.get(k, 'derived')})" for k, v in comp.derived.items()))
    if comp.dropped:
        lines.append(f"not taken from the job's files (algorithm.name={cfg.algorithm.name} has no such settings): "
                     + ", ".join(f"{k}={_show(v)}" for k, v in comp.dropped.items()))
    shipped = shipped_values(comp, unread)
    if shipped:
        lines.append(f"from the job's files ({_source(comp)} and the shipped files it builds on): "
                     + ", ".join(f"{k}={_show(v)}" for k, v in shipped.items()))
    return lines


def _convention(term) -> str:
    runs = term.runs
    if runs in GRADERS:
        return f"grader {runs}, against the reference answer"
    if runs in BUILT_IN:
        return BUILT_IN[runs]
    if is_user_function(runs):
        fn, convention = load_user_function(runs)
        params = [p for p in inspect.signature(fn).parameters if p not in ("kwargs",)]
        if convention == TRL:
            return f"{runs}, TRL's reward function ({', '.join(params)})"
        return f"{runs}, verl's compute_score (data_source, solution_str, ground_truth = the reference answer, extra_info)"
    return runs


def reward_lines(cfg: JobConfig, prompts) -> list[str]:
    """The RL job's reward terms, each with its function's convention and weight, and the reference answer
    they read (``data.answer_key``'s column, resolved)."""
    if not registry.get(cfg.algorithm.name).online:
        return []
    terms = reward_terms(cfg)
    parts = [f"{t.name} x {t.weight:g} ({_convention(t)}{', whitened' if t.whiten else ''})" for t in terms]
    lines = ["rewards: " + "; ".join(parts)]
    if cfg.rollout.environment in HUB_ENVIRONMENTS:  # built before the summary (launchers.input_checks.hub_prompts)
        lines.append(hub_line(cfg.rollout))
    train = getattr(prompts, "train", None)
    key = getattr(train, "answer_key", None)
    if cfg.data.train_files and any(t.runs not in MODEL_FUNCTIONS for t in terms):
        lines.append(f"reference answer: {('column ' + key) if key else 'none (no answer column; data.answer_key=null)'}")
    return lines


def data_lines(cfg: JobConfig, prompts) -> list[str]:
    """The data summary (records, duplicates dropped, tokens, held-out split) and, for an RL job, its steps."""
    if prompts is None:
        return []
    lines = [prompts.summary()]
    unused = getattr(prompts, "unused_columns", ())
    if unused:
        lines.append(f"columns the job does not read: {', '.join(unused)}")
    if registry.get(cfg.algorithm.name).online and hasattr(prompts, "train"):
        t = cfg.trainer
        steps = total_steps(cfg, len(prompts.train))
        how = (f"trainer.steps={t.steps}" if t.steps else
               f"trainer.steps=0: {t.epochs} epoch(s) of {len(prompts.train)} prompts, rollout.prompts_per_step="
               f"{cfg.rollout.prompts_per_step}")
        lines.append(f"steps: {steps} ({how})")
    return lines


def length_lines(cfg: JobConfig, hf_config, prompts) -> list[str]:
    """An RL job's response and context lengths, with where the context came from."""
    if not registry.get(cfg.algorithm.name).online:
        return []
    r = cfg.rollout
    positions = text_config(hf_config).max_position_embeddings
    longest = getattr(prompts, "longest", 0)
    return [f"lengths: rollout.max_tokens={r.max_tokens}, eval_max_tokens={r.eval_max_tokens}, max_model_len="
            f"{r.max_model_len} (the longest prompt: {longest} tokens; the model's positions: {positions})"]


#: what each tracker reads its destination from (launchers/trackers.py)
TRACKER_SETTINGS = {"wandb": ("WANDB_MODE", "WANDB_DIR"), "mlflow": ("MLFLOW_TRACKING_URI",), "trackio": ("TRACKIO_DIR",)}


def logging_line(cfg: JobConfig) -> str:
    """Where the scalars go (``logger.backends``), each tracker with the settings it reads that are set."""
    parts = []
    for b in cfg.logger.backends:
        if b == "tensorboard":
            parts.append(f"tensorboard ({Path(cfg.output_dir) / 'tensorboard'})")
            continue
        env = [f"{k}={os.environ[k]}" for k in TRACKER_SETTINGS[b] if os.environ.get(k)]
        if b == "wandb" and not os.environ.get("WANDB_DIR"):
            env.append(f"files in {cfg.output_dir}/wandb")
        parts.append(f"{b} ({', '.join(env) or 'its defaults'})")
    trackers = any(b != "tensorboard" for b in cfg.logger.backends)
    project = f"; project {cfg.logger.project}" if cfg.logger.project and trackers else ""
    return f"logging: {', '.join(parts) or 'nowhere (logger.backends=[])'}{project}"


def resume_line(cfg: JobConfig, note: str | None) -> str:
    """Resume or fresh start: the checkpoint ``trainer.resume`` would load and its step."""
    from alignment.training.checkpoint import checkpoint_step, latest_checkpoint

    directory = Path(cfg.output_dir) / "checkpoints"
    latest = latest_checkpoint(directory) if cfg.trainer.resume and directory.is_dir() else None
    if latest is not None:
        text = f"resume: from step {checkpoint_step(latest)} ({latest})"
    elif not cfg.trainer.resume and directory.is_dir() and any(directory.iterdir()):
        text = f"fresh start (trainer.resume=false: {directory}'s checkpoints will be overwritten as it goes)"
    else:
        text = f"fresh start (no checkpoint in {directory})"
    return text + (f"; {note}" if note else "")


def job_summary(comp: Composition | None, cfg: JobConfig, hf_config, prompts, note: str | None, world: int,
                unread=()) -> list[str]:
    """Every line of the start-up summary (module docstring), for ``world`` processes."""
    from alignment.rollout.config import rollout_ranks
    from launchers.memory_plan import job_memory, memory_line

    unread = unread or unread_settings(cfg)
    lines = composition_lines(comp, unread) if comp is not None else []
    lines += data_lines(cfg, prompts) + reward_lines(cfg, prompts) + length_lines(cfg, hf_config, prompts)
    lines.append(resume_line(cfg, note))
    lines.append(logging_line(cfg))
    try:
        memory = job_memory(cfg, hf_config, world - rollout_ranks(cfg.rollout), cfg.cluster.gpu_memory_gib)
        lines.append(memory_line(memory, cfg.cluster.gpu_memory_gib))
    except (ValueError, AttributeError, TypeError):
        lines.append("memory: the planner does not size this model (a vision-language model's tower)")
    return lines


def unread_settings(cfg) -> dict[str, str]:
    """Every setting of ``cfg`` the job does not read (:func:`alignment.reads.unread_keys`; a section's
    keys once, under the section), each with why."""
    out: dict[str, str] = {}
    for key, why in unread_keys(cfg, job_keys(algorithm_section(cfg))).items():
        if not any(key.startswith(k + ".") for k in out):
            out[key] = why
    return out


def mark_unread(text: str, unread: dict[str, str]) -> str:
    """The YAML ``text`` of a config with ``# not read: ...`` after each setting in ``unread`` (a section's
    header for a whole section)."""
    out, path = [], []
    for line in text.splitlines():
        stripped = line.lstrip(" ")
        indent = (len(line) - len(stripped)) // 2
        if stripped.startswith("- ") or ":" not in stripped or not stripped.split(":", 1)[0].replace("_", "").isalnum():
            out.append(line)
            continue
        key = stripped.split(":", 1)[0]
        path = path[:indent] + [key]
        dotted = ".".join(path)
        value = stripped.split(":", 1)[1].strip()
        open_quote = value[:1] in ("'", '"') and (len(value) < 2 or value[-1] != value[0])  # a multi-line scalar
        out.append(f"{line}  # not read: {unread[dotted]}" if dotted in unread and not open_quote else line)
    return "\n".join(out) + "\n"
