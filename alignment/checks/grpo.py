"""The checks across sections of GRPO's step (:mod:`alignment.trainers.grpo`): ``algorithm.name=grpo`` and,
through its parts, ``distill`` and algorithms of your own built on the step (:mod:`alignment.checks`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from alignment.algorithms.config import ROUTING_REPLAY, GRPOFamilyConfig, check_estimators
from alignment.data.config import check_prompt_source
from alignment.rollout.config import played_by_agents
from alignment.schema import ConfigError

if TYPE_CHECKING:
    from alignment.config import JobConfig
    from alignment.models.dims import ModelDims
    from parallel.layout import ParallelLayout


def validate(cfg: JobConfig, layout: ParallelLayout, dims: ModelDims) -> None:
    """GRPO: a prompt source, estimators that exist, routing replay the model and engine can do, sampling at a
    temperature > 0 with >= 2 samples per prompt, and batches that divide."""
    r = cfg.rollout
    check_prompt_source(cfg.data)
    check_estimators(cfg.algorithm)
    routing_replay(cfg.algorithm, dims)
    rollout_routing(cfg)
    if r.temperature <= 0:
        raise ConfigError(f"rollout.temperature={r.temperature}: GRPO samples, it needs a temperature > 0")
    if r.group_size < 2:
        raise ConfigError(f"rollout.group_size={r.group_size}: GRPO needs at least 2 samples per prompt")
    batches(cfg, layout)


def batches(cfg: JobConfig, layout: ParallelLayout) -> None:
    """The step's batches: prompts that deal evenly over data-parallel ranks, micro-batches that divide each
    rank's samples, mini-batches that divide its micro-batches."""
    a, r, t = cfg.algorithm, cfg.rollout, cfg.trainer
    dp = layout.data_parallel_size
    if r.prompts_per_step % dp:
        valid = [k * dp for k in range(1, 5)]
        raise ConfigError(f"rollout.prompts_per_step={r.prompts_per_step} must be a multiple of the data-parallel "
                          f"size {dp} (world {layout.world_size} / (TP x PP x CP)); e.g. {valid}")
    per_rank = r.prompts_per_step // dp * r.group_size
    if per_rank % t.micro_batch_size:
        valid = [m for m in range(1, per_rank + 1) if per_rank % m == 0]
        raise ConfigError(f"trainer.micro_batch_size={t.micro_batch_size} must divide the {per_rank} samples each "
                          f"data-parallel rank trains on per step (prompts_per_step / DP x group_size); "
                          f"valid values: {valid}")
    if (per_rank // t.micro_batch_size) % a.num_mini_batches:
        raise ConfigError(f"algorithm.num_mini_batches={a.num_mini_batches} must divide the {per_rank // t.micro_batch_size}"
                          f" micro-batches of each data-parallel rank")


def routing_replay(a: GRPOFamilyConfig, dims: ModelDims) -> None:
    """``algorithm.routing_replay``: a value that exists, a mixture-of-experts model to route, for
    ``r2`` an old-logprob pass to record, for ``r3`` an engine that records its routing."""
    if a.routing_replay not in ROUTING_REPLAY:
        raise ConfigError(f"algorithm.routing_replay={a.routing_replay!r}: valid values are {', '.join(ROUTING_REPLAY)}")
    if a.routing_replay == "none":
        return
    if not dims.num_experts:
        raise ConfigError(f"algorithm.routing_replay={a.routing_replay}: the model is dense (no experts to route); "
                          "set algorithm.routing_replay=none")
    if a.routing_replay == "r2" and a.ppo_epochs == 1 and a.num_mini_batches == 1:
        raise ConfigError("algorithm.routing_replay=r2 forces the old-logprob pass's experts in the updates of a batch, "
                          "but with algorithm.ppo_epochs=1 and algorithm.num_mini_batches=1 the one update is that pass; "
                          "set algorithm.ppo_epochs or algorithm.num_mini_batches > 1")


def rollout_routing(cfg: JobConfig) -> None:
    """``algorithm.routing_replay=r3`` replays the rollout engine's routing, which both engines record
    (vLLM's inside the engine: :mod:`alignment.rollout.engines.vllm_routes`), but not for episodes played
    through the rollout server by agents or an environment hub."""
    r = cfg.rollout
    if cfg.algorithm.routing_replay != "r3":
        return
    if r.backend == "vllm" and r.enforce_eager is False:
        raise ConfigError("algorithm.routing_replay=r3 records vLLM's routers' choices through a Python hook, which a "
                          "compiled engine skips; leave rollout.enforce_eager unset (r3 runs vLLM eager) or set it true")
    if played_by_agents(r):
        raise ConfigError("algorithm.routing_replay=r3 replays the experts the rollout engine routed each token to, "
                          "which episodes played through the rollout server (rollout.agent, rollout.agent_command, "
                          f"rollout.environment={r.environment}) do not carry; set algorithm.routing_replay=r2 or none")
