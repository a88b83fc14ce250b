"""Multi-turn episodes on a rollout engine: the engine generates a turn (until EOS or the
environment's stop string, e.g. ``</tool_call>``), the environment answers
(:class:`alignment.envs.base.Environment`), its answer is appended as tokens
(:class:`alignment.rollout.episodes.turn_tokens.TurnTokens`) and the engine continues from the whole
token sequence, until the environment ends the episode, ``max_turns`` model turns were taken or
the token budget is spent.

Each episode becomes one :class:`alignment.data.samples.Sample`: ``response_ids`` every token after
the prompt (the model's and the environment's, in order, exactly as generated and inserted),
``logprobs`` the engine's on the model's tokens (0 on the others), ``loss_mask`` 1 on the model's
tokens only, so the trainer's logprobs, the loss, the KL, GAE and the critic see the model's
tokens only. The single-turn environment with ``max_turns=1`` gives the samples of one
:meth:`RolloutEngine.generate` call (``loss_mask`` None).

The token budget is ``SamplingConfig.max_tokens`` for the whole response (model and environment
tokens together, as verl's ``response_length``), so prompt + response stays within the engine's
``max_model_len``; an observation that does not fit ends the episode unfinished.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from alignment.data.tasks import Problem
from alignment.data.images import ImageProcessor
from alignment.envs.base import Environment
from alignment.envs.factory import build_environment
from alignment.data.samples import OnDone, Sample, SamplingConfig
from alignment.rollout.engines.factory import eos_token_ids
from alignment.rollout.engines.image_prompts import ImagePrompt, image_prompts, images_of
from alignment.rollout.engines.routed_experts import earliest_routes
from alignment.rollout.episodes.turn_tokens import TurnTokens

__all__ = ["run_episodes", "EpisodeSetup", "episode_setup", "EPISODE_COUNTS", "cut_sample"]

#: the per-episode counts in ``Sample.info`` (summed over turns)
EPISODE_COUNTS = ("turns", "tool_calls", "tool_errors", "env_tokens")


@dataclass
class EpisodeSetup:
    """What a job's episodes run with: the environment (``rollout.environment``), the chat template's
    turn tokens, ``rollout.max_turns``, ``rollout.max_tokens_per_turn`` and, for a vision-language
    model, its image processor (prompts with images become
    :class:`alignment.rollout.engines.image_prompts.ImagePrompt` s)."""

    env: Environment
    turns: TurnTokens
    max_turns: int = 1
    max_tokens_per_turn: int | None = None
    images: ImageProcessor | None = None


def episode_setup(cfg, hf_dir: Path, tokenizer, images: ImageProcessor | None = None) -> EpisodeSetup:
    """The job's :class:`EpisodeSetup` from its config: the environment ``rollout.environment``
    (:func:`alignment.envs.factory.build_environment`), the turn tokens of ``tokenizer``'s chat
    template (``data.chat_template_kwargs``; the end-of-turn ids from ``hf_dir``'s generation
    config and the tokenizer), ``rollout.max_turns``, ``rollout.max_tokens_per_turn`` and the image
    processor ``images`` of a vision-language model."""
    kwargs = dict(cfg.data.chat_template_kwargs or {})
    return EpisodeSetup(build_environment(cfg), TurnTokens(tokenizer, eos_token_ids(hf_dir, tokenizer), kwargs),
                        cfg.rollout.max_turns, cfg.rollout.max_tokens_per_turn, images)


@dataclass
class _Episode:
    problem: Problem
    prompt_ids: list[int]
    messages: list[dict]
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    counts: dict = field(default_factory=lambda: dict.fromkeys(EPISODE_COUNTS, 0))
    env_reward: float = 0.0
    text: str = ""
    last_turn: list[int] = field(default_factory=list)
    finished: bool = False
    routed: torch.Tensor | None = None  # [positions, layers, k]: each turn's routing, the earliest kept
    updates: list[int] = field(default_factory=list)  # per response token: Sample.weight_updates

    def add_turn(self, s: Sample) -> None:
        # the turn's prompt is the episode so far: it covers every position; each keeps its first turn's routing
        self.routed = earliest_routes(self.routed, s.routed_experts)
        self.ids += s.response_ids
        self.logprobs += s.logprobs
        self.updates += s.weight_updates or [0] * len(s.response_ids)
        self.mask += [1] * len(s.response_ids)
        self.text, self.finished, self.last_turn = s.text, s.finished, list(s.response_ids)
        self.messages.append({"role": "assistant", "content": s.text})
        self.counts["turns"] += 1

    def add_observation(self, messages: list[dict], ids: list[int]) -> None:
        self.ids += ids
        self.logprobs += [0.0] * len(ids)
        self.updates += [self.updates[-1] if self.updates else 0] * len(ids)
        self.mask += [0] * len(ids)
        self.messages += messages
        self.counts["env_tokens"] += len(ids)

    def sample(self) -> Sample:
        mask = None if all(self.mask) else list(self.mask)
        info = {**self.counts, "env_reward": self.env_reward, "messages": self.messages}
        routed = None
        if self.routed is not None:  # -1 on environment tokens no turn has seen yet
            routed = torch.full((len(self.prompt_ids) + len(self.ids), *self.routed.shape[1:]), -1, dtype=torch.int16)
            routed[: self.routed.shape[0]] = self.routed[: routed.shape[0]]
        return Sample(self.prompt_ids, self.ids, self.logprobs, self.text, self.finished, mask, info, routed,
                      list(self.updates) if any(self.updates) else None, images_of(self.prompt_ids))


def _continued(prompt: list[int], ids: list[int]) -> list[int]:
    """The prompt of an episode's next turn: its prompt and every token since (its images kept)."""
    return ImagePrompt(list(prompt) + ids, prompt.images) if isinstance(prompt, ImagePrompt) else prompt + ids


def cut_sample(s: Sample, budget: int, tokenizer) -> Sample:
    """``s`` cut to ``budget`` tokens (a prefix of a sample is a sample: its logprobs stay right)."""
    if len(s.response_ids) <= budget:
        return s
    ids = s.response_ids[:budget]
    routed = None if s.routed_experts is None else s.routed_experts[: len(s.prompt_ids) + budget]
    return replace(s, response_ids=ids, logprobs=s.logprobs[:budget], finished=False,
                   text=tokenizer.decode(ids, skip_special_tokens=True), routed_experts=routed,
                   weight_updates=None if s.weight_updates is None else s.weight_updates[:budget])


def _answer(env: Environment, live: list[_Episode], turns: TurnTokens, budget: int, max_turns: int) -> list[_Episode]:
    """Step ``env`` on every live episode's latest message; append the observations of those that go
    on and return them. An episode ends when the environment says so (finished when its turn
    was), or unfinished when it took ``max_turns`` turns or the observation plus one more token
    would not fit the budget (a turn cut by the budget always ends it)."""
    moves = env.step([e.problem for e in live], [e.messages for e in live], [e.text for e in live]) if live else []
    going = []
    for e, t in zip(live, moves):
        e.env_reward += float(t.reward)
        for k, v in t.info.items():
            if k in e.counts:
                e.counts[k] += int(v)
        if t.done:
            continue
        if e.counts["turns"] >= max_turns:
            e.finished = False  # the environment was not done: out of turns
            continue
        ids = turns.continuation_ids(e.last_turn, t.observation)
        if len(e.ids) + len(ids) >= budget:
            e.finished = False
            continue
        e.add_observation(t.observation, ids)
        going.append(e)
    return going


def run_episodes(generate: Callable[..., list[list[Sample]]], env: Environment,
                 problems: Sequence[Problem], turns: TurnTokens, sampling: SamplingConfig, max_turns: int,
                 keep_going: Callable[[bool], bool] | None = None,
                 max_tokens_per_turn: int | None = None, on_done: OnDone | None = None,
                 images: ImageProcessor | None = None) -> list[list[Sample]]:
    """``sampling.n`` episodes per problem, in problem order.

    Args:
        generate: the engine's ``generate(prompts, sampling, on_done=None)`` (or
            :func:`alignment.trainers.rl_phases.generate_for_group` bound to it). The first turn asks
            ``n`` samples of each prompt (vLLM shares the prompt's KV); each later turn one call with
            a continuation per live episode, at the largest budget left (an episode's turn is cut to
            its own budget afterwards).
        env: answers every turn; its ``stop`` strings are added to ``sampling.stop``.
        turns: renders the prompt and the tokens between turns.
        sampling: temperature, top-p, ``n`` and ``max_tokens``: the budget of the whole response.
        max_turns: model turns per episode (>= 1).
        max_tokens_per_turn: the most tokens of one model turn (None: what is left of the budget); a
            turn cut there is closed by the template's end of turn and the environment answers it.
        keep_going: called after each turn (but with ``max_turns=1``) with whether this rank has
            live episodes; returns whether any rank has (a collective, so every rank calls
            ``generate`` as often: TP>1 engines and model replicas generate together). None: this
            rank's answer.
        on_done: with ``max_turns=1``, the engine's ``on_done`` of the only turn: called with a
            problem's index and its ``n`` answers as soon as they are generated (the episodes' texts),
            e.g. to start running their code (:func:`alignment.rewards.code_runs.prefetcher`). Not
            called for multi-turn episodes, whose last answer is known only at the end.
        images: a vision-language model's image processor: the prompts of problems with ``images``
            become :class:`alignment.rollout.engines.image_prompts.ImagePrompt` s (decoded and encoded here).
    Returns:
        ``[len(problems)][n]`` samples (see the module docstring).
    Raises:
        ValueError: ``max_turns`` < 1 or ``max_tokens_per_turn`` < 1; as
            :func:`alignment.rollout.engines.image_prompts.image_prompts`.
    """
    if max_turns < 1:
        raise ValueError(f"rollout.max_turns={max_turns}: must be >= 1")
    if max_tokens_per_turn is not None and max_tokens_per_turn < 1:
        raise ValueError(f"rollout.max_tokens_per_turn={max_tokens_per_turn}: must be >= 1 (or null)")
    keep_going = keep_going or (lambda any_live: any_live)
    stop = list(dict.fromkeys((sampling.stop or []) + list(env.stop or []))) or None
    opening = env.reset(problems)
    prompts = image_prompts(images, problems, [turns.prompt_ids(m) for m in opening])
    cap = sampling.max_tokens if max_tokens_per_turn is None else min(max_tokens_per_turn, sampling.max_tokens)
    first_turn = replace(sampling, stop=stop, max_tokens=cap)
    first = generate(prompts, first_turn, on_done) if on_done is not None and max_turns == 1 else \
        generate(prompts, first_turn)
    episodes = [[_Episode(p, prompt, [dict(x) for x in msgs]) for _ in range(sampling.n)]
                for p, prompt, msgs in zip(problems, prompts, opening)]
    live = []
    for group, outs in zip(episodes, first):
        for e, s in zip(group, outs):
            e.add_turn(s)
            live.append(e)
    while True:
        live = _answer(env, live, turns, sampling.max_tokens, max_turns)
        if max_turns == 1 or not keep_going(bool(live)):
            break
        left = [min(sampling.max_tokens - len(e.ids), cap) for e in live]
        outs = generate([_continued(e.prompt_ids, e.ids) for e in live],
                        replace(sampling, n=1, stop=stop, max_tokens=max(left, default=1)))
        for e, out, budget in zip(live, outs, left):
            e.add_turn(cut_sample(out[0], budget, turns.tokenizer))
    return [[e.sample() for e in group] for group in episodes]
