"""Typed configuration of every job (Hydra structured config): RL (GRPO and variants, PPO)
and training on fixed data (SFT, reward model, DPO family), picked by ``algorithm.name``.

:class:`JobConfig` is the schema: Hydra checks every YAML value and command-line override against
it (unknown keys and wrong types are errors). Each of its sections is declared beside the feature
that reads it, with the checks of its own values:

- ``model``: :mod:`alignment.models.config` (dtype, LoRA targets);
- ``data``: :mod:`alignment.data.config` (prompt source, generator, dataset);
- ``rollout``: :mod:`alignment.rollout.config` (placement, backend, engine TP, episodes, lengths);
- ``algorithm``: :mod:`alignment.algorithms.config` (policy loss, estimators, loss type);
- ``reward``: :mod:`alignment.rewards.config` (reward functions);
- ``trainer``: :mod:`alignment.training.config` (metric bounds);
- ``parallel``, ``cluster``, ``profile``, ``logger``: here (the parallel sizes are checked against the model
  by :func:`parallel.layout.validate_model_layout`).

Every numeric field's range is in its metadata (:func:`alignment.schema.ranged`), checked first
(:func:`validate_ranges`). :func:`validate` then runs each section's checks and what depends on
several sections, the world size and the model, then the algorithm's own checks across sections (its
record's ``validate``: :mod:`alignment.checks`), before any process group starts.
Field names follow Megatron (``tensor_model_parallel_size``, ``micro_batch_size``), RL
(``kl_coef``, ``clip_ratio``) and vLLM (``temperature``, ``max_tokens``) usage.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from dataclasses import dataclass, field
from typing import Any, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from alignment.algorithms import registry
from alignment.algorithms.config import (GRPOFamilyConfig, GroupAdvantageConfig, PolicyGradientConfig, check_policy_loss,
                                         has_section)
from alignment.data.config import DataConfig
from alignment.envs.factory import HUB_ENVIRONMENTS
from alignment.models.config import ModelConfig, check_lora, check_model
from alignment.models.families import model_dims, text_config
from alignment.rewards.config import PROCESS_REWARD, RewardConfig, check_functions, is_pairwise
from alignment.rewards.policy import ppo_on_task, process_reward_weight, reward_terms
from alignment.rewards.text import FORMAT_TASKS
from alignment.rollout.agents.programs import AgentError, load_agent
from alignment.rollout.config import (RolloutConfig, check_backend, check_engine_tp, check_episodes, check_lengths,
                                      check_partial, check_placement, played_by_agents, rollout_ranks)
from alignment.schema import ConfigError, Range, dotted, field_ranges, per_task, ranged, unbounded
from alignment.training.config import TrainerConfig, check_metric_bounds
from parallel.layout import ParallelLayout, validate_model_layout
from parallel.packing import alignment


@dataclass
class ParallelConfig:
    """Megatron parallel sizes; data parallelism is the rest of the world size."""

    # TP: every layer's weights split over this many ranks (divides the heads)
    tensor_model_parallel_size: int = ranged(1, 1)
    pipeline_model_parallel_size: int = ranged(1, 1)  # PP: the layers split into this many stages
    # Megatron's sequence parallelism: norms and dropout split over TP ranks by sequence
    sequence_parallel: bool = False
    context_parallel_size: int = ranged(1, 1)  # split every sequence over this many ranks (zig-zag)
    cp_comm_type: str = "p2p"  # p2p: ring attention; a2a: Ulysses all-to-all (transformer-engine's names)
    # mixture-of-experts models: experts shared out over this many ranks (folded over the dense grid)
    expert_model_parallel_size: int = ranged(1, 1)
    # each expert split over this many ranks; null: TP
    expert_tensor_parallel_size: Optional[int] = ranged(None, 1, note=' (null: tensor_model_parallel_size)')


@dataclass
class ClusterConfig:
    """Where the job runs (``configs/cluster/``): the allocation nemo-run asks for
    (``launchers/nemo_launch.py``) and, when ``gpus_per_node > 0``, the world size every rank
    checks at start (``nodes x gpus_per_node`` processes, one per GPU)."""

    name: str = "local"  # the cluster config's name (configs/cluster/)
    nodes: int = ranged(1, 1)  # nodes of the allocation
    # processes per node; 0: whatever the launcher started (not checked)
    gpus_per_node: int = ranged(0, 0, note=' (0: not checked)')
    partition: str = ""  # Slurm partition (nemo-run's SlurmExecutor)
    account: str = ""  # Slurm account (nemo-run's SlurmExecutor)
    time: str = "04:00:00"  # Slurm --time
    preempt_signal_seconds: int = ranged(300, 0)  # Slurm --signal=B:USR1@<seconds>: checkpoint this long before the end
    # each GPU's memory: a job whose planned memory per GPU (launchers/memory_plan.py) is above 95 % of it is
    # refused at start; null: not checked (a CPU machine)
    gpu_memory_gib: Optional[float] = ranged(None, 0, low_in=False, note=' (GiB; null: not checked)')


#: ``logger.backends`` values, each with the package it needs (None: torch's own)
LOGGER_BACKENDS = {"tensorboard": None, "wandb": "wandb", "mlflow": "mlflow", "trackio": "trackio"}


@dataclass
class LoggerConfig:
    """Where a run's scalars, config and tables go (:mod:`launchers.trackers`): TensorBoard and the experiment
    trackers teams compare runs in, each with the same names and steps, written by rank 0. Each backend reads its
    own settings from the environment (W&B: ``WANDB_MODE``, ``WANDB_DIR``, ``WANDB_ENTITY``, ``WANDB_API_KEY``;
    MLflow: ``MLFLOW_TRACKING_URI``; Trackio: ``TRACKIO_DIR``)."""

    # tensorboard (<output_dir>/tensorboard), wandb, mlflow, trackio (pip install 'megalign[trackers]')
    backends: list[str] = unbounded(factory=lambda: ["tensorboard"])
    # the W&B project, MLflow experiment and Trackio project; null: WANDB_PROJECT / MLFLOW_EXPERIMENT_NAME, else megalign
    project: Optional[str] = None
    # a tracker that cannot start (package missing, server unreachable): fail (one line, before training), or
    # warn (go on with the others, say so once)
    on_error: str = "fail"


def check_logger(c: LoggerConfig) -> None:
    """``logger``'s values: known backends, each once, installed (unless ``on_error=warn``).

    Raises:
        ConfigError: naming the field and the fix."""
    unknown = [b for b in c.backends if b not in LOGGER_BACKENDS]
    if unknown or len(set(c.backends)) != len(c.backends):
        raise ConfigError(f"logger.backends={list(c.backends)}: give each of {', '.join(LOGGER_BACKENDS)} at most once")
    if c.on_error not in ("fail", "warn"):
        raise ConfigError(f"logger.on_error={c.on_error!r}: valid values are fail, warn")
    missing = [b for b in c.backends if LOGGER_BACKENDS[b] and importlib.util.find_spec(str(LOGGER_BACKENDS[b])) is None]
    if missing and c.on_error == "fail":
        raise ConfigError(f"logger.backends has {', '.join(missing)}, but the package is not installed: pip install "
                          f"'megalign[trackers]' (or {' '.join(missing)}), or set logger.on_error=warn to go on without it")


@dataclass
class ProfileConfig:
    """``profile.enabled``: ``torch.profiler`` traces of chosen steps on chosen ranks, plus a
    memory report (peak RSS on CPU; CUDA peak allocated/reserved and a memory snapshot on GPU).
    Read by :mod:`launchers.profiling`; ``tools/profile_step.py`` turns a run into a report."""

    enabled: bool = False  # trace profile.steps on profile.ranks with torch.profiler
    steps: list[int] = unbounded(factory=lambda: [2])  # optimizer steps to trace, 1-based (step 1 warms up)
    ranks: list[int] = unbounded(factory=lambda: [0])  # global ranks that trace
    dir: str = "${output_dir}/profile"  # traces: <dir>/rank<r>_step<s>.*.pt.trace.json (Chrome/TensorBoard)
    record_shapes: bool = True  # torch.profiler's record_shapes
    profile_memory: bool = True  # torch.profiler's profile_memory
    with_stack: bool = False  # torch.profiler's with_stack (slower, larger traces)
    memory_snapshot: bool = True  # GPU: torch.cuda.memory snapshot of the traced steps (pytorch.org/memory_viz)


@dataclass
class JobConfig:
    """A whole job (schema ``job_schema``, alias ``grpo_schema``; YAML defaults in ``configs/*.yaml``)."""

    # the run's name (TensorBoard, the output directory); null: <algorithm>_<data> (e.g. grpo_prompts), which a
    # job on your own data takes unless you set it (alignment/compose.py)
    run_name: Optional[str] = per_task(None)
    output_dir: str = "outputs/${run_name}"  # checkpoints, config.yaml, summary.json, tensorboard/, logs/
    seed: int = ranged(1234, 0)  # every random choice: sampling, data order, initialisation
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    # the algorithm's own section (its record's config class: alignment/algorithms/registry.py), typed once
    # its name is known (alignment/compose.py); a plain mapping until then
    algorithm: Any = field(default_factory=lambda: {"name": "grpo"})
    reward: RewardConfig = field(default_factory=RewardConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)

    def __post_init__(self):
        if isinstance(self.algorithm, dict):  # built in Python, not composed: the section of its algorithm
            self.algorithm = registry.get(self.algorithm.get("name", "grpo")).config(**self.algorithm)


def algorithm_section(cfg) -> type:
    """The class of ``cfg``'s ``algorithm`` section (a composed ``DictConfig`` or a :class:`JobConfig`): its
    algorithm's record's ``config``, below :class:`alignment.algorithms.config.AlgorithmConfig`."""
    section = cfg.algorithm
    return OmegaConf.get_type(section) if OmegaConf.is_config(section) else type(section)


def register() -> None:
    """Register the schema as ``job_schema`` (and ``grpo_schema``) for configs' ``defaults`` lists."""
    for name in ("job_schema", "grpo_schema"):
        ConfigStore.instance().store(name=name, node=JobConfig)


def job_config(cfg) -> JobConfig:
    """The typed config every component reads: a composed Hydra config (``DictConfig``) turned into
    :class:`JobConfig` by ``OmegaConf.to_object`` (interpolations resolved, nested dataclasses and
    plain dicts and lists), once, at the entry (``launchers/train.py``'s ``run``, the preflight);
    a :class:`JobConfig` is returned as is."""
    return cfg if isinstance(cfg, JobConfig) else OmegaConf.to_object(cfg)


def config_yaml(cfg: JobConfig) -> str:
    """``cfg`` as the YAML a run writes to ``<output_dir>/config.yaml`` (what resumes compare)."""
    return OmegaConf.to_yaml(OmegaConf.structured(cfg) if isinstance(cfg, JobConfig) else cfg, resolve=True)


def parallel_sizes(parallel: ParallelConfig) -> dict:
    """``parallel``'s fields by name: the keyword arguments of :class:`parallel.layout.ParallelLayout`
    and of :func:`alignment.models.gpt.transformer_config`."""
    return {f.name: getattr(parallel, f.name) for f in dataclasses.fields(ParallelConfig)}


#: the algorithms by what they can do (their records: alignment/algorithms/registry.py)
RL_ALGORITHMS = registry.names(online=True)
TASK_ALGORITHMS = registry.names(asks_task=True)  # the jobs that ask data.task's questions
OFFLINE_ALGORITHMS = registry.names(online=False)
PROCESS_ESTIMATORS = ("grpo", "grpo_no_std")  # the GRPO-family estimators process_reward has advantages for


def total_steps(cfg, train_size: int) -> int:
    """An RL job's optimizer steps: ``trainer.steps``, or with 0 ``trainer.epochs`` passes over the
    ``train_size`` training prompts (``rollout.prompts_per_step`` a step, the last partial step left out)."""
    t = cfg.trainer
    return t.steps if t.steps else max(1, t.epochs * train_size // cfg.rollout.prompts_per_step)


def ranges(cls=None, algorithm: type | None = None) -> dict[str, Range]:
    """Dotted field -> its :class:`alignment.schema.Range`, for every numeric field of ``cls`` (default
    :class:`JobConfig`, with ``algorithm``'s section: a class below
    :class:`alignment.algorithms.config.AlgorithmConfig`) that has one (:func:`alignment.schema.ranged`)."""
    out = field_ranges(cls or JobConfig)
    if algorithm is not None:
        out.update({f"algorithm.{k}": r for k, r in field_ranges(algorithm).items()})
    return out


def every_range() -> dict[str, Range]:
    """:func:`ranges` with the keys of every registered algorithm's section (docs/reference/bad-inputs.md's
    list; the catalogue's out-of-range cases)."""
    out = ranges()
    for algorithm in registry.ALGORITHMS.values():
        out.update(ranges(algorithm=algorithm.config))
    return out


def validate_ranges(cfg) -> None:
    """Every numeric field of ``cfg`` in its range (:func:`ranges`), checked first by :func:`validate`,
    so an out-of-range number is named with its range before anything uses it (a zero micro-batch
    size would otherwise surface as a division by zero).

    Raises:
        ConfigError: the first field out of range, with its range and meaning.
    """
    for name, rng in ranges(algorithm=type(cfg.algorithm)).items():
        value = dotted(cfg, name)
        if rng.excludes(value):
            raise ConfigError(f"{name}={value}: must be {rng.describe()}{rng.note}")


def _validate_staleness(r, a) -> None:
    """``rollout.max_staleness`` > 0: off-policy batches need importance weights in the loss."""
    # rft and online_dpo: SFT and DPO losses, which take samples from any policy
    if r.max_staleness > 0 and has_section(a, PolicyGradientConfig) and a.rollout_correction.is_level is None:
        raise ConfigError(f"rollout.max_staleness={r.max_staleness} trains on samples from a policy up to "
                          f"{r.max_staleness} step(s) old, so the loss must weight each token by pi_old / pi_rollout "
                          "(decoupled PPO): set algorithm.rollout_correction.is_level=token (or sequence), "
                          "truncated at algorithm.rollout_correction.is_threshold, or rollout.max_staleness=0")


def _validate_rewards(cfg: JobConfig) -> None:
    """``reward`` in this job: none for fixed-data jobs; for RL jobs, functions that check
    (:func:`alignment.rewards.config.check_functions`) and that this job can compute (answers to
    grade, a group to compare, a reward model to load)."""

    functions = list(cfg.reward.functions)
    a = cfg.algorithm
    prm_path = cfg.reward.process_reward_model
    if not registry.get(a.name).online:
        if prm_path:
            raise ConfigError(f"reward.process_reward_model is set, but algorithm.name={a.name} trains on fixed data "
                              "and computes no rewards; set reward.process_reward_model='' (it applies to the RL jobs)")
        if functions:
            raise ConfigError(f"reward.functions is set, but algorithm.name={a.name} trains on fixed data and "
                              "computes no rewards; set reward.functions=[] (it applies to the RL jobs)")
        return

    check_functions(cfg.reward)
    names = [f.name for f in functions]
    if cfg.data.train_files and not functions:
        raise ConfigError("data.train_files: prompts of your own need reward.functions to score the answers, e.g. "
                          "[{name: math_verify}] against data.answer_key, or [{name: my_pkg.rewards:score}]")
    if cfg.data.train_files and {"correctness", "format"} & set(names):
        raise ConfigError(f"reward.functions has {sorted({'correctness', 'format'} & set(names))}, which grade "
                          "data.task's built-in problems; with data.train_files use a grader (math_verify, "
                          "exact_match, numeric, regex, code_tests) or a function of your own")
    for t in reward_terms(cfg):
        if is_pairwise(t) and cfg.rollout.group_size < 2:
            raise ConfigError(f"reward.functions[{t.name}].mode=pairwise compares a prompt's responses with each other; "
                              f"rollout.group_size={cfg.rollout.group_size} gives one: set rollout.group_size >= 2")
    if registry.of(cfg).job == "ppo" and {"correctness", "format"} & set(names) and "reward_model" in names:
        raise ConfigError(f"reward.functions={names}: with a reward_model term PPO trains on {cfg.data.dataset}'s "
                          "prompts, which have no answers to grade; use reward_model and length, or drop reward_model "
                          "to train on data.task's problems")
    if "format" in names and cfg.data.task not in FORMAT_TASKS:
        raise ConfigError(f"reward.functions has format, but data.task={cfg.data.task} asks for no answer format "
                          f"(format applies to {', '.join(FORMAT_TASKS)})")
    if "reward_model" in names and not cfg.model.reward_model_path:
        raise ConfigError("reward.functions has reward_model, but model.reward_model_path is empty: give the HF "
                          "export of a trained reward model (e.g. outputs/rm_smollm2_dpo_en_demo/hf from "
                          "--config-name rm)")
    _validate_process_reward(cfg, functions, prm_path)


def _validate_process_reward(cfg, functions, prm_path: str) -> None:
    """The dense ``process_reward`` term: a PRM to load, for the jobs that take per-token rewards."""
    a = cfg.algorithm
    term = next((f for f in functions if f.name == PROCESS_REWARD), None)
    if term is None:
        if prm_path:
            raise ConfigError(f"reward.process_reward_model={prm_path} is set, but reward.functions has no "
                              "process_reward term to use it; add {name: process_reward, weight: 1.0} to "
                              "reward.functions (or set reward.process_reward_model='')")
        return
    if not prm_path:
        raise ConfigError("reward.functions has process_reward, but reward.process_reward_model is empty: give the "
                          "HF export of a process reward model (e.g. outputs/prm_smollm2/hf from --config-name prm)")
    if not registry.get(a.name).process_reward:
        raise ConfigError(f"reward.functions has process_reward, a dense per-step reward, but algorithm.name={a.name} "
                          "judges whole samples; it applies to the GRPO family and PPO")
    if has_section(a, GroupAdvantageConfig) and a.advantage_estimator not in PROCESS_ESTIMATORS:
        raise ConfigError(f"reward.functions has process_reward, whose step rewards become group-normalised advantages "
                          f"(DeepSeekMath's process supervision), defined for algorithm.advantage_estimator in "
                          f"{', '.join(PROCESS_ESTIMATORS)}, not {a.advantage_estimator}")
    if term.whiten:
        raise ConfigError("reward.functions[process_reward].whiten=true: its step rewards are normalised per group "
                          "(GRPO) or folded into whitened advantages (PPO) already; set whiten=false")
    if not a.step_separator:
        raise ConfigError("algorithm.step_separator is empty: give the string that ends a step, e.g. '\\n'")
    if has_section(a, GRPOFamilyConfig) and a.dynamic_sampling:
        raise ConfigError("algorithm.dynamic_sampling keeps the groups whose sample rewards differ, but with "
                          "process_reward a group of equal sample rewards still has step rewards to learn from; set "
                          "algorithm.dynamic_sampling=false")


def _validate_episodes(cfg: JobConfig) -> None:
    """``rollout.environment`` in this job (its own values: :func:`alignment.rollout.config.check_episodes`):
    multi-turn episodes in GRPO-family jobs and PPO on a task, with no process reward."""

    r, a = cfg.rollout, cfg.algorithm
    check_episodes(r)
    if played_by_agents(r):
        _validate_agents(cfg)
    if r.environment == "single_turn":
        return
    if not registry.get(a.name).episodes and not ppo_on_task(cfg):
        raise ConfigError(f"rollout.environment={r.environment} runs multi-turn episodes in GRPO-family and distill jobs and in "
                          f"PPO on data.task (reward.functions without reward_model); algorithm.name={a.name} "
                          "samples single answers here; set rollout.environment=single_turn")
    if process_reward_weight(cfg):
        raise ConfigError(f"reward.functions has process_reward, which scores the steps of one answer; with "
                          f"rollout.environment={r.environment} a response holds several turns and tool outputs; "
                          "drop process_reward or set rollout.environment=single_turn")


def _validate_agents(cfg: JobConfig) -> None:
    """``rollout.agent`` / ``agent_command``: one of them, importable, in a job whose episodes can be played by
    it (GRPO, or PPO on a task), on colocated engines sampling on-policy; the agent is the environment."""
    r, a = cfg.rollout, cfg.algorithm
    if r.agent and r.agent_command:
        raise ConfigError(f"rollout.agent={r.agent} and rollout.agent_command are both set: give one")
    hub = r.environment in HUB_ENVIRONMENTS
    given = f"rollout.environment={r.environment}" if hub else \
        f"rollout.agent={r.agent}" if r.agent else "rollout.agent_command"
    if hub and (r.agent or r.agent_command):
        raise ConfigError(f"rollout.environment={r.environment}'s rollouts play the episodes; rollout.agent / "
                          "agent_command would be a second player: unset it")
    if hub and not any(t.name == "environment" for t in reward_terms(cfg)):
        raise ConfigError(f"rollout.environment={r.environment} scores each episode with the environment's rubric, but "
                          "reward.functions has no environment term to train on it: add {name: environment} (or "
                          "leave reward.functions empty: the rubric alone)")
    if not registry.get(a.name).agents and not ppo_on_task(cfg):
        raise ConfigError(f"{given} plays GRPO-family episodes (and PPO's on data.task); algorithm.name={a.name} "
                          "samples otherwise; unset it")
    if r.environment != "single_turn" and not hub:
        raise ConfigError(f"{given} is the episode's environment (it runs the tools); rollout.environment="
                          f"{r.environment} would be a second one: set rollout.environment=single_turn")
    if r.placement != "colocated" or r.max_staleness:
        raise ConfigError(f"{given} serves the agents from the trainers' engines while they wait; rollout.placement="
                          f"{r.placement}, max_staleness={r.max_staleness} are not supported with it yet: set "
                          "placement=colocated, max_staleness=0")
    if process_reward_weight(cfg):
        raise ConfigError("reward.functions has process_reward, which scores the steps of one answer; an agent's "
                          "episode holds several turns: drop process_reward")
    if r.agent:
        try:
            load_agent(r.agent)
        except AgentError as e:
            raise ConfigError(str(e)) from e


def _validate_lengths(cfg, layout, hf_config, tokenizer_size: int | None) -> None:
    """The tokenizer fits the embedding; the longest sequence, padded to the CP/SP alignment,
    fits the model's positions (a vision-language model's language model: its ``text_config``)."""

    hf_config = text_config(hf_config)
    if tokenizer_size is not None and tokenizer_size > hf_config.vocab_size:
        raise ConfigError(f"model.path={cfg.model.path}: its tokenizer has {tokenizer_size} tokens but the model's "
                          f"vocab_size is {hf_config.vocab_size}, so token ids >= {hf_config.vocab_size} would index "
                          f"past the embedding; use the model's own tokenizer")
    align = alignment(layout.context_parallel_size, layout.tensor_model_parallel_size, layout.sequence_parallel)
    field, longest = (("data.max_length", cfg.data.max_length) if not registry.get(cfg.algorithm.name).online
                      else ("rollout.max_model_len", cfg.rollout.max_model_len))
    padded = -(-longest // align) * align
    if longest <= hf_config.max_position_embeddings < padded:  # longer still: refused by the length checks
        raise ConfigError(f"{field}={longest} padded to a multiple of {align} (2 x context_parallel_size"
                          f"{' x tensor_model_parallel_size with sequence_parallel' if layout.sequence_parallel else ''}"
                          f") is {padded} > the model's max_position_embeddings={hf_config.max_position_embeddings}; "
                          f"set {field}<={hf_config.max_position_embeddings // align * align}")


VISION_LANGUAGE_ALGORITHMS = registry.names(takes_images=True)


def _validate_vision_language(cfg, layout, dims) -> None:
    """A vision-language model (Qwen2.5-VL, Qwen3-VL) trains with SFT, DPO (its variants), the GRPO family, RFT,
    online DPO and on-policy distillation (a vision-language teacher) so far, on any layout with DeepStack's layers
    on the first pipeline stage; its rollouts run on Megatron's engine or a colocated vLLM, one turn each, and prompts are not shared in packed micro-batches (M-RoPE positions
    are per row)."""
    a, r = cfg.algorithm, cfg.rollout
    chunks = layout.pipeline_model_parallel_size * (layout.virtual_pipeline_model_parallel_size or 1)
    if dims.deepstack_layers > dims.num_layers // chunks:
        raise ConfigError(f"parallel.pipeline_model_parallel_size={layout.pipeline_model_parallel_size}: the first "
                          f"pipeline stage would hold {dims.num_layers // chunks} decoder layers, and DeepStack adds "
                          f"image features to the first {dims.deepstack_layers} (vision_config.deepstack_visual_indexes)"
                          "; use a smaller pipeline (or virtual pipeline) size")
    if not registry.get(a.name).takes_images:
        raise ConfigError(f"model.path={cfg.model.path} is a vision-language model: algorithm.name={a.name} is not "
                          f"supported for it yet; use one of {', '.join(VISION_LANGUAGE_ALGORITHMS)} "
                          f"(--config-name {' / '.join(VISION_LANGUAGE_ALGORITHMS)})")
    if not registry.get(a.name).online:
        return
    if r.backend == "vllm" and r.placement != "colocated":
        raise ConfigError(f"rollout.placement={r.placement}: a vision-language model's vLLM rollouts run colocated "
                          "so far (images are not sent to engines on ranks of their own); set rollout.placement="
                          "colocated or rollout.backend=megatron")
    if r.environment != "single_turn" or r.max_turns != 1 or r.agent or r.agent_command:
        raise ConfigError(f"rollout.environment={r.environment}, rollout.max_turns={r.max_turns}: a vision-language "
                          "model's rollouts are single-turn so far; set rollout.environment=single_turn, "
                          "rollout.max_turns=1 and no rollout.agent / rollout.agent_command")
    if r.partial_carry_over:
        raise ConfigError("rollout.partial_carry_over=true continues text prompts, not yet a vision-language model's "
                          "image prompts; set rollout.partial_carry_over=false")
    if cfg.trainer.shared_prompt_packing:
        raise ConfigError("trainer.shared_prompt_packing=true: a vision-language model's M-RoPE positions are per "
                          "row; set it to false (trainer.sequence_packing works)")


def resolve_for_model(cfg: JobConfig, hf_config) -> JobConfig:
    """Settings whose null default depends on the model, resolved in ``cfg`` (by :func:`validate`, first):
    ``trainer.shared_prompt_packing`` is off for a vision-language model (its prompt trees would have no
    M-RoPE positions); ``rollout.max_model_len`` is the model's ``max_position_embeddings`` (lowered to what
    the prompts need once they are read: :func:`fit_context`). Returns ``cfg``."""
    if cfg.trainer.shared_prompt_packing is None and model_dims(hf_config).is_vision_language:
        cfg.trainer.shared_prompt_packing = False
    if cfg.rollout.max_model_len is None:
        cfg.rollout.max_model_len = text_config(hf_config).max_position_embeddings
    return cfg


def fit_context(cfg: JobConfig, longest_prompt: int) -> int:
    """``rollout.max_model_len`` left null: the longest prompt (``longest_prompt`` tokens) plus the longest
    answer (``rollout.max_tokens`` or ``eval_max_tokens``), at most the model's positions (what
    :func:`resolve_for_model` set); set in ``cfg`` and returned. Then the checks that depend on it.

    Raises:
        ConfigError: ``trainer.max_tokens_per_microbatch`` below it.
    """
    r = cfg.rollout
    r.max_model_len = min(r.max_model_len, longest_prompt + max(r.max_tokens, r.eval_max_tokens))
    check_microbatch_tokens(cfg)
    return r.max_model_len


def check_microbatch_tokens(cfg: JobConfig) -> None:
    """``trainer.max_tokens_per_microbatch`` holds the longest sequence a rollout can make.

    Raises:
        ConfigError: naming both and the fix.
    """
    t, r = cfg.trainer, cfg.rollout
    if 0 < t.max_tokens_per_microbatch < r.max_model_len:
        raise ConfigError(f"trainer.max_tokens_per_microbatch={t.max_tokens_per_microbatch} is below "
                          f"rollout.max_model_len={r.max_model_len}, the longest sequence a rollout can make; "
                          f"raise it to at least {r.max_model_len} (or 0 for micro_batch_size rows)")


def validate(cfg: JobConfig, *, world_size: int, hf_config, tokenizer_size: int | None = None) -> None:
    """Check values that depend on each other, the world size and the model (``tokenizer_size``:
    tokens of the model's tokenizer, checked against its vocabulary when given). ``cfg``: a
    :class:`JobConfig` (a composed ``DictConfig`` is turned into one: :func:`job_config`).

    Raises:
        ConfigError / parallel.layout.LayoutError: naming the field and valid values.
    """

    cfg = job_config(cfg)
    validate_ranges(cfg)  # every numeric field in its range first (docs/reference/bad-inputs.md)
    try:
        dims = model_dims(hf_config)  # the family: a clear error for an unsupported architecture
    except ValueError as e:
        raise ConfigError(f"model.path={cfg.model.path}: {e}") from e
    context_given = cfg.rollout.max_model_len is not None  # null: fit to the prompts once read (fit_context)
    resolve_for_model(cfg, hf_config)
    if cfg.rollout.placement == "disaggregated" and not registry.get(cfg.algorithm.name).online:
        raise ConfigError(f"rollout.placement=disaggregated: algorithm.name={cfg.algorithm.name} trains on fixed "
                          "data and generates nothing; use rollout.placement=colocated")
    check_placement(cfg.rollout, world_size)
    check_partial(cfg.rollout)
    engines = rollout_ranks(cfg.rollout)  # ranks that only generate; the others train
    layout = ParallelLayout(world_size=world_size - engines, **parallel_sizes(cfg.parallel))
    validate_model_layout(layout, dims)
    if dims.is_vision_language:
        _validate_vision_language(cfg, layout, dims)
    check_lora(cfg.model.lora, dims)
    r, t = cfg.rollout, cfg.trainer
    _validate_lengths(cfg, layout, hf_config, tokenizer_size)
    c = cfg.cluster
    if c.gpus_per_node and world_size != c.nodes * c.gpus_per_node:
        raise ConfigError(f"cluster.nodes x cluster.gpus_per_node = {c.nodes} x {c.gpus_per_node} = "
                          f"{c.nodes * c.gpus_per_node} processes, but {world_size} were started: launch one "
                          f"process per GPU, or set cluster=local / cluster.gpus_per_node=0")
    prof = cfg.profile
    if prof.enabled and (not prof.steps or min(prof.steps) < 1):
        raise ConfigError(f"profile.steps={list(prof.steps)}: give 1-based optimizer steps, e.g. [2] (step 1 warms up)")
    if prof.enabled and (not prof.ranks or min(prof.ranks) < 0 or max(prof.ranks) >= layout.world_size):
        raise ConfigError(f"profile.ranks={list(prof.ranks)}: global ranks of trainers, in [0, {layout.world_size}), "
                          "e.g. [0]")
    check_metric_bounds(t)
    check_logger(cfg.logger)
    if t.max_tokens_per_microbatch and layout.pipeline_model_parallel_size > 1 and not t.sequence_packing:
        raise ConfigError("trainer.max_tokens_per_microbatch with parallel.pipeline_model_parallel_size > 1 needs "
                          "trainer.sequence_packing=true (pipeline stages exchange one shape for every micro-batch; "
                          "packed micro-batches are one row each, padded micro-batches would differ in rows)")
    check_model(cfg.model)
    if cfg.model.teacher_path and not registry.get(cfg.algorithm.name).teacher:
        raise ConfigError(f"model.teacher_path={cfg.model.teacher_path} is set, but algorithm.name={cfg.algorithm.name} "
                          "has no teacher; set algorithm.name=distill, or model.teacher_path=''")
    _validate_rewards(cfg)
    if cfg.data.instruction is not None and not registry.get(cfg.algorithm.name).asks_task and not ppo_on_task(cfg):
        raise ConfigError(f"data.instruction is set, but algorithm.name={cfg.algorithm.name} does not ask data.task's "
                          f"questions (it applies to {', '.join(TASK_ALGORITHMS)}, and ppo with reward.functions on "
                          "data.task's answers); set data.instruction=null")
    if not registry.of(cfg).online:
        return registry.of(cfg).checks()(cfg, layout, dims)  # the algorithm's own (alignment/checks/)

    check_engine_tp(r, engines or world_size, cfg.parallel, hf_config)
    check_backend(r, layout)
    _validate_episodes(cfg)
    if t.shared_prompt_packing and (layout.context_parallel_size > 1 or layout.sequence_parallel):
        raise ConfigError(f"trainer.shared_prompt_packing=true does not run with parallel.context_parallel_size="
                          f"{layout.context_parallel_size} / parallel.sequence_parallel={layout.sequence_parallel} "
                          "(a prompt tree's attention spans the whole tree, and its output positions are "
                          "picked before the output layer); set context_parallel_size=1 and sequence_parallel=false, "
                          "or trainer.shared_prompt_packing=null (on where it runs) or false")
    if context_given:
        check_microbatch_tokens(cfg)
    a = cfg.algorithm
    if has_section(a, PolicyGradientConfig):
        check_policy_loss(a)
    _validate_staleness(cfg.rollout, a)
    resampled = has_section(a, GRPOFamilyConfig) and a.dynamic_sampling
    if r.partial and resampled:
        raise ConfigError("algorithm.dynamic_sampling refills a batch after it was collected, which with "
                          "rollout.partial=true is after the weights changed, not counted per token yet; set one of "
                          "them to false")
    if r.partial_carry_over and registry.of(cfg).trainer != "alignment.trainers.grpo":  # agents: max_staleness=0
        raise ConfigError(f"rollout.partial_carry_over=true carries GRPO's single answers across steps, not "
                          f"algorithm.name={a.name}'s; set rollout.partial_carry_over=false")
    if a.overlong_buffer_len and not 0 < a.overlong_buffer_len <= r.max_tokens:  # a reward term of every RL job
        raise ConfigError(f"algorithm.overlong_buffer_len={a.overlong_buffer_len} must be in (0, rollout.max_tokens="
                          f"{r.max_tokens}], or 0 to disable")
    if resampled and layout.pipeline_model_parallel_size > 1 and not t.sequence_packing and any(
            term.name == "reward_model" for term in reward_terms(cfg)):
        raise ConfigError("algorithm.dynamic_sampling with a reward_model term scores each sampling round's groups, "
                          "whose count need not fill whole micro-batches; with parallel.pipeline_model_parallel_size > "
                          "1 set trainer.sequence_packing=true (one packed row per micro-batch)")
    registry.of(cfg).checks()(cfg, layout, dims)  # the algorithm's own (alignment/checks/)
    check_lengths(r, hf_config)
