"""The phases every RL step shares, whatever the algorithm (GRPO family, PPO): what one rank
holds is :class:`alignment.trainers.models.Models`; generation over a model replica, forward-only logprobs, the sampled
batch (:class:`Rollout`), the rollout-vs-trainer mismatch metrics and the weight sync into the
rollout engine. The loop that runs them is :mod:`launchers.loop`; each algorithm's
``collect`` and ``train`` live in :mod:`alignment.trainers.grpo` and :mod:`alignment.trainers.ppo`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypedDict, TypeVar, cast

import torch
import torch.distributed as dist

from alignment.config import JobConfig
from alignment.data.images import ImageProcessor
from alignment.data.prompts import PromptStyle, build_prompt_ids
from alignment.data.tasks import Problem
from alignment.models.weights import export_hf_weights
from alignment.data.samples import OnDone, Sample, SamplingConfig
from alignment.envs.base import Environment, Transition
from alignment.rollout.base import RolloutEngine
from alignment.rollout.config import RolloutConfig
from alignment.rollout.episodes.dataset_answers import DatasetAnswers
from alignment.rollout.engines.image_prompts import image_prompts
from alignment.rollout.episodes.multi_turn import EpisodeSetup, run_episodes
from alignment.rollout.engines.weight_check import check_engine_weights
from alignment.trainers.models import Models
from alignment.training.batching import MicroBatching, cat_rows
from alignment.training.config import TrainerConfig
from alignment.training.megatron_step import (LogprobOutputs, VocabOutputs, all_reduce_max, all_reduce_sum,
                                              forward_backward, is_output_rank, value_outputs)
from alignment.training.routing_replay import RoutingPass
from parallel.reshard import Resharder
from parallel.state import replica_group

if TYPE_CHECKING:  # process_rewarding imports this module
    from alignment.trainers.process_rewarding import StepRewards

_T = TypeVar("_T")


class PassLayout(TypedDict):
    """The layout keywords of :func:`alignment.training.megatron_step.forward_backward`, the same for every pass of
    a step: ``packing`` (``trainer.sequence_packing``), ``share_prompts`` (``trainer.shared_prompt_packing``)."""

    packing: bool
    share_prompts: bool


@dataclass
class Rollout:
    """One step's sampled and rewarded batch on this DP rank: what a collector hands the trainer.

    ``samples`` (prompt/response ids, the engine's sampled logprobs), ``rewards [N]`` (one per
    sample), ``batch`` (padded tensors when the collector already built them: PPO scores the
    padded batch), ``info`` (collector statistics, e.g. dynamic-sampling rounds), ``seconds``
    (wall time of the collection), ``version``: the number of optimizer steps of the policy
    that sampled it (the behaviour policy), and ``step``: the loop step that trains on it
    (``step - version`` is its staleness when trained; :mod:`launchers.loop` sets it).
    ``reward_terms``: each reward function's raw scores ``[N]`` (``reward.functions``), of which
    ``rewards`` is the weighted (optionally whitened) sum. ``steps``: the dense ``process_reward``
    term's step scores (:class:`alignment.trainers.process_rewarding.StepRewards`), None without one.
    ``problems``: the problem of each group of samples, in order, when they are not the ones the collector was
    given (partial rollouts carried across steps train the groups that finished first); empty otherwise.
    """

    samples: list[Sample]
    rewards: torch.Tensor
    version: int
    step: int = -1
    batch: dict[str, torch.Tensor] | None = None
    info: dict[str, float] = field(default_factory=dict)
    seconds: float = 0.0
    reward_terms: dict[str, torch.Tensor] = field(default_factory=dict)
    steps: StepRewards | None = None
    problems: list[Any] = field(default_factory=list)


@contextmanager
def rollout_phase(models: Models, teacher: bool = False) -> Iterator[None]:
    """Generation: only the engine on the device (and the policy, when the engine runs the policy's
    own model: ``rollout.backend=megatron``), the engine woken before and put to sleep after (its
    KV cache freed while the trainer works). ``teacher``: the teacher's engine instead
    (``models.teacher_engine``, on the teacher's own shards)."""
    engine = cast(RolloutEngine, models.teacher_engine if teacher else models.engine)  # an online job's
    models.placement.keep(*((("teacher" if teacher else "policy"),) if engine.shares_trainer_weights else ()))
    engine.wake()
    try:
        yield
    finally:
        engine.sleep()


def sampling_config(r: RolloutConfig) -> SamplingConfig:
    """``rollout.group_size`` samples per prompt at the rollout's temperature, top-p and ``max_tokens``
    (what every RL job asks its engine for)."""
    return SamplingConfig(n=r.group_size, temperature=r.temperature, top_p=r.top_p, max_tokens=r.max_tokens)


def request(tokenizer: Any, problems: list[Problem], cfg: JobConfig, images: ImageProcessor | None = None
            ) -> tuple[list[list[int]], SamplingConfig]:
    """What an RL job asks its engine for ``problems``: their prompts (token ids, the task's chat
    prompt; :class:`alignment.rollout.engines.image_prompts.ImagePrompt` s for problems with images, encoded by
    ``images``, the model's image processor) and ``group_size`` samples each at the rollout's sampling
    settings. Raises as :func:`alignment.rollout.engines.image_prompts.image_prompts`."""
    style = PromptStyle.of(cfg.data)
    prompts = image_prompts(images, problems, [build_prompt_ids(tokenizer, p, style) for p in problems])
    return prompts, sampling_config(cfg.rollout)


def image_processor(models: Models) -> ImageProcessor | None:
    """The model's image processor (a vision-language model's; None for a text model or without an engine)."""
    return models.episodes.images if models.episodes is not None else None


def generate_for_group(engine: RolloutEngine, prompts: list[list[int]], sampling: SamplingConfig,
                       on_done: OnDone | None = None) -> list[list[Sample]]:
    """Generate for this DP rank's prompts, splitting the work over the ranks of its
    model replica (TP x CP x PP, each has an engine) and gathering every rank's samples; an
    engine that runs the replica's own shards (``generates_per_replica``: the ``megatron``
    backend) generates them all on every rank of the replica together, alike. ``on_done(i,
    samples)``: on the rank that generated prompt ``i`` (an index into ``prompts``), as soon as
    its samples are finished."""
    if engine.generates_per_replica:
        return engine.generate(prompts, sampling, on_done)
    group = replica_group()
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    mine = None if on_done is None else (lambda k, samples: on_done(rank + k * size, samples))
    # called even with no prompts: collective for TP>1 engines
    return _dealt_over_replica(lambda part: engine.generate(part, sampling, mine), prompts)


class ReplicaGeneration:
    """``engine`` as :func:`generate_for_group` runs it: ``generate(prompts, sampling)`` deals the prompts over the
    ranks of this DP rank's model replica and gathers the samples, so every rank of the replica holds them all
    (what :class:`alignment.rollout.engines.carryover.CarryOverPool` grows its rows with). Collective over the replica."""

    def __init__(self, engine: RolloutEngine):
        self.engine = engine

    def generate(self, prompts: list[list[int]], sampling: SamplingConfig) -> list[list[Sample]]:
        """``[len(prompts)][sampling.n]`` samples."""
        return generate_for_group(self.engine, prompts, sampling)


def _dealt_over_replica(run: Callable[..., list[_T]], items: list[Any], *more: list[Any]) -> list[_T]:
    """``run`` on this rank's share of ``items`` (every ``size``-th of them, and of each list of
    ``more`` alike) over the ranks of the model replica, the results gathered back in order."""

    group = replica_group()
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    if size == 1:
        return list(run(items, *more))
    mine = run(items[rank::size], *(m[rank::size] for m in more))
    gathered: list[Any] = [None] * size
    dist.all_gather_object(gathered, mine, group=group)
    out: list[Any] = [None] * len(items)
    for r, part in enumerate(gathered):
        out[r::size] = part
    return out


def step_for_group(env: Environment, problems: list[Problem], messages: list[list[dict[str, Any]]], replies: list[str]
                   ) -> list[Transition]:
    """``env.step`` on this DP rank's live episodes, dealt over the ranks of its model replica (which
    all hold the same episodes) and gathered, so every rank of the replica continues with the same
    observations even when a tool's output varies from run to run, and no tool runs twice."""
    return _dealt_over_replica(lambda r, p, m: env.step(p, m, r) if r else [], replies, problems, messages)


class _ReplicaEnvironment:
    """An environment whose steps :func:`step_for_group` deals over the model replica."""

    def __init__(self, env: Environment) -> None:
        self.env, self.stop = env, env.stop

    def reset(self, problems: Sequence[Problem]) -> list[list[dict[str, Any]]]:
        return self.env.reset(problems)

    def step(self, problems: Sequence[Problem], messages: Sequence[list[dict[str, Any]]], replies: Sequence[str]
             ) -> list[Transition]:
        return step_for_group(self.env, list(problems), list(messages), list(replies))


def generate_episodes(models: Models, problems: list[Problem], sampling: SamplingConfig, on_done: OnDone | None = None,
                      teacher: bool = False, answers: Sequence[str] | None = None) -> list[list[Sample]]:
    """``sampling.n`` episodes for each of this DP rank's ``problems`` in ``models.episodes``'
    environment (:func:`alignment.rollout.episodes.multi_turn.run_episodes`): every turn generated by
    :func:`generate_for_group`, every environment step by :func:`step_for_group`, turns taken in
    step by every rank (collective). ``on_done``: as :func:`run_episodes`'. ``teacher``: the
    teacher's engine answers (``models.teacher_engine``). ``answers``: one text per problem answers it
    instead of any engine (``algorithm.distill_samples=dataset``, single-turn;
    :class:`alignment.rollout.episodes.dataset_answers.DatasetAnswers`, local to each rank). Returns
    ``[len(problems)][n]`` samples."""

    e = cast(EpisodeSetup, models.episodes)  # an online job's
    engine = cast(RolloutEngine, models.teacher_engine if teacher else models.engine)  # unused with answers
    generate = (DatasetAnswers(e.turns, answers).generate if answers is not None else
                lambda prompts, s, done=None: generate_for_group(engine, prompts, s, done))
    return run_episodes(generate,
                        _ReplicaEnvironment(e.env), problems, e.turns, sampling, e.max_turns,
                        keep_going=lambda live: bool(all_reduce_sum([float(live)])[0]),
                        max_tokens_per_turn=e.max_tokens_per_turn, on_done=on_done, images=e.images)


def episode_metrics(samples: list[Sample], count: bool) -> dict[str, float]:
    """Multi-turn statistics over the global batch (``count``: whether this rank's samples count, one
    rank per data-parallel replica; collective): ``episode/turns`` model turns per episode,
    ``episode/tool_call_rate`` the fraction of episodes with a tool call, ``episode/tool_calls`` per
    episode, ``episode/tool_error_rate`` failed calls per call (0 without calls),
    ``episode/env_tokens`` and ``episode/generated_tokens`` per episode, ``episode/env_reward``."""
    def total(f: Callable[[Sample], float]) -> float:
        return float(sum(f(x) for x in samples)) if count else 0.0

    n, turns, calling, calls, errors, env_tokens, generated, reward = all_reduce_sum([
        float(len(samples)) if count else 0.0, total(lambda x: x.info.get("turns", 1)),
        total(lambda x: x.info.get("tool_calls", 0) > 0), total(lambda x: x.info.get("tool_calls", 0)),
        total(lambda x: x.info.get("tool_errors", 0)), total(lambda x: x.info.get("env_tokens", 0)),
        total(lambda x: x.generated_tokens), total(lambda x: _known(x.info.get("env_reward", 0.0)))])
    n = max(n, 1.0)
    return {"episode/turns": turns / n, "episode/tool_call_rate": calling / n, "episode/tool_calls": calls / n,
            "episode/tool_error_rate": errors / max(calls, 1.0), "episode/env_tokens": env_tokens / n,
            "episode/generated_tokens": generated / n, "episode/env_reward": reward / n}


def _known(value: float) -> float:
    """An environment reward, 0 when unscored (an agent that returned None: NaN)."""
    return 0.0 if value != value else float(value)


def token_staleness(samples: list[Sample], staleness: int, count: bool, buckets: int = 0) -> dict[str, float]:
    """``rollout/token_staleness`` (mean over the global batch's generated tokens) and
    ``rollout/token_staleness_max``: how many optimizer steps older than the trained policy the policy
    that sampled each token was, ``staleness`` (the batch's, ``step - Rollout.version``) minus the weight
    updates its engine took during the batch (``Sample.weight_updates``, partial rollouts). ``buckets`` k > 0: also
    the histogram, ``rollout/token_staleness_hist/<a>`` the fraction of the tokens ``a`` steps old for ``a`` in
    ``0 .. k - 1`` (older ones in the last). ``count``: whether this rank's samples count (one rank per
    data-parallel replica); collective."""
    hist = [0.0] * buckets
    tokens = total = 0.0
    worst = -1.0
    for s in samples if count else ():
        mask = s.loss_mask or [1] * len(s.response_ids)
        updates = s.weight_updates or [0] * len(s.response_ids)
        ages = [staleness - u for u, m in zip(updates, mask) if m]
        tokens, total = tokens + len(ages), total + sum(ages)
        worst = max([worst, *ages])
        for a in ages if buckets else ():
            hist[min(a, buckets - 1)] += 1
    tokens, total, *hist = all_reduce_sum([tokens, total, *hist])
    [worst] = all_reduce_max([worst])
    out = {"rollout/token_staleness": total / max(tokens, 1.0), "rollout/token_staleness_max": max(worst, 0.0)}
    return {**out, **{f"rollout/token_staleness_hist/{a}": c / max(tokens, 1.0) for a, c in enumerate(hist)}}


def post_for_group(engine: Any, prompts: list[list[int]], sampling: SamplingConfig) -> None:
    """Start, without waiting, the generation that :func:`generate_for_group` with the same
    arguments will then return (an engine with ``prefetch``: rollout ranks of its own); each rank
    posts the share :func:`generate_for_group` would ask for."""

    group = replica_group()
    engine.prefetch(prompts[dist.get_rank(group)::dist.get_world_size(group)], sampling)


def policy_logprobs(model: torch.nn.Module, microbatches: list[dict[str, torch.Tensor]], vocab_size: int,
                    temperature: float = 1.0, packing: bool = False, positions: str | None = "response_mask",
                    share_prompts: bool = False, distribution: bool = False, routing: RoutingPass | None = None
                    ) -> torch.Tensor | None:
    """Forward-only logprobs ``[N, seq]`` of ``softmax(logits / temperature)`` in batch row
    order (last pipeline stage; ``None`` elsewhere). ``packing``: ``trainer.sequence_packing``;
    ``positions``: the micro-batch mask whose positions are computed (0 elsewhere; ``None``: all);
    ``share_prompts``: prompt trees (``trainer.shared_prompt_packing``); see
    :func:`alignment.training.megatron_step.forward_backward`. ``distribution``: the whole
    distribution instead, ``[N, seq, V]`` fp32 (:class:`alignment.training.megatron_step.VocabOutputs`;
    zeros off ``positions``). ``routing``: the pass's MoE routing (record, replay;
    :class:`alignment.training.routing_replay.RoutingPass`)."""
    key = "vocab_logprobs" if distribution else "logprobs"

    def collect(mb: dict[str, torch.Tensor], out: dict[str, torch.Tensor]
                ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return out[key].sum() * 0, {key: out[key]}

    outputs = (VocabOutputs if distribution else LogprobOutputs)(vocab_size, temperature)
    with torch.no_grad():
        out = forward_backward(model, microbatches, collect, outputs=outputs, forward_only=True, packing=packing,
                               positions=positions, share_prompts=share_prompts, routing=routing)
    return cat_rows(out, key, microbatches) if out else None


def head_outputs(model: torch.nn.Module, mbs: list[dict[str, torch.Tensor]], packing: bool = False,
                 share_prompts: bool = False) -> torch.Tensor | None:
    """Forward-only scalar-head outputs ``[N, seq]`` in batch row order (last pipeline stage;
    None elsewhere). ``packing``: ``trainer.sequence_packing``; ``share_prompts``: prompt trees
    (``trainer.shared_prompt_packing``)."""
    with torch.no_grad():
        out = forward_backward(model, mbs, lambda mb, o: (o["values"].sum() * 0, {"v": o["values"]}),
                               outputs=value_outputs, forward_only=True, packing=packing, share_prompts=share_prompts)
    return cat_rows(out, "v", mbs) if out else None


def microbatches(batch: dict[str, torch.Tensor], trainer: TrainerConfig) -> list[dict[str, torch.Tensor]]:
    """``trainer.micro_batch_size`` rows, or ``trainer.max_tokens_per_microbatch`` tokens, per micro-batch."""
    return MicroBatching.from_trainer(trainer).split(batch)



def correction_metrics(outs: list[dict[str, torch.Tensor]], tokens: float) -> dict[str, float]:
    """The rollout-vs-trainer mismatch over the global batch from the loss metrics of every
    micro-batch (:func:`alignment.algorithms.rollout_correction.rollout_correction`): k3 KL and
    mean importance weight per token, fraction of tokens masked, largest token ratio; one
    contribution per model replica; collective. ``tokens``: the global valid-token count.
    ``is_weight_std``: the weights' standard deviation over the tokens (0 with the correction off)."""
    mine = is_output_rank() and bool(outs)
    kl, weight, square, masked = all_reduce_sum([sum(float(o[k]) for o in outs) if mine else 0.0
                                                 for k in ("rollout_kl_sum", "is_weight_sum", "is_weight_sq_sum",
                                                           "masked_tokens")])
    [ratio_max] = all_reduce_max([max(float(o["rollout_ratio_max"]) for o in outs) if mine else 0.0])
    mean = weight / tokens
    return {"rollout_correction/kl": kl / tokens, "rollout_correction/is_weight_mean": mean,
            "rollout_correction/is_weight_std": max(square / tokens - mean * mean, 0.0) ** 0.5,
            "rollout_correction/masked_fraction": masked / tokens, "rollout_correction/ratio_max": ratio_max}


def sync_weights(models: Models, check: bool = False) -> dict[str, float]:
    """New policy weights into every rank's running vLLM engine, in memory (nothing to do for an
    engine that runs the policy's own model: ``{}``).

    Megatron shards -> this rank's vLLM TP shard, rank to rank in bounded buckets
    (``models.resharder``, :mod:`parallel.reshard`), streamed into the engine; ``check`` verifies
    every engine parameter (``rollout.check_weight_sync``). Returns timing and traffic metrics
    (``weight_sync/...``).
    """
    engine = cast(RolloutEngine, models.engine)  # an online job's
    if engine.shares_trainer_weights:
        return {}
    resharder = cast(Resharder, models.resharder)  # an engine with weights of its own is fed by one
    st = resharder.stats
    before = (st.seconds, st.sent_bytes)
    out = engine.load_resharded(resharder.buckets())
    reshard_s = st.seconds - before[0]
    metrics = {"weight_sync/reshard_s": reshard_s, "weight_sync/engine_load_s": out["load_s"] - reshard_s,
               "weight_sync/sent_mb": (st.sent_bytes - before[1]) / 2**20,
               "weight_sync/peak_staged_mb": st.peak_staged_bytes / 2**20}
    if check:

        hf = export_hf_weights(models.policy, models.bridge)  # the independent (gather) path
        rtol = 1e-4 if next(iter(hf.values())).dtype == torch.float32 else 2e-2
        metrics["weight_sync/checked"] = float(check_engine_weights(
            engine, hf, models.bridge, out["names"], resharder.vllm_tp,
            dist.get_rank() % resharder.vllm_tp, rtol))
    return metrics


