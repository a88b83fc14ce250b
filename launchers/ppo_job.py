"""PPO job (``algorithm.name=ppo``), run by ``launchers/train.py --config-name ppo``.

config -> validate -> groups -> policy (from ``model.path``, e.g. the SFT export) + reference,
critic (from ``model.critic_path`` or the reward model) and frozen reward model
(``model.reward_model_path``) + rollout engine (``rollout.backend``) -> the RL loop
(:mod:`launchers.loop`) with PPO's collect and train (:mod:`alignment.trainers.ppo`) on the
dpo_en_demo training prompts, evaluated by :class:`WinRate`: held-out greedy responses of the
initial policy and of the trained one, scored by the reward model -> win rate (trained vs
initial) and response-length drift. With ``reward.functions`` on ``data.task``'s answers (no
``reward_model`` term, :func:`alignment.config.ppo_on_task`): the task's problems, in
``rollout.environment``'s episodes, no reward model loaded, evaluated by held-out accuracy.
"""

from __future__ import annotations

import json

import torch

from alignment.config import JobConfig
from alignment.data.chat_data import encode_prompt, load_preference_pairs
from alignment.data.prompt_data import training_order
from alignment.rewards.policy import ppo_on_task, process_reward_weight
from alignment.data.samples import SamplingConfig
from alignment.trainers import ppo, rl_phases
from alignment.trainers.heldout import HeldoutAccuracy
from alignment.trainers.rewarding import padded_batch, reward_model_scores
from alignment.trainers.rl_phases import generate_for_group, rollout_phase
from alignment.trainers.interfaces import JobSpec
from alignment.training.megatron_step import all_reduce_sum, is_output_rank
from launchers import loop
from launchers.build import build_models
from launchers.common import start


def roles(cfg) -> list[str]:
    """The models a PPO job builds (:func:`launchers.build.build_models`): the policy, the critic and
    the engine; the reference with ``algorithm.kl_coef`` > 0; the reward model unless the job trains
    on ``data.task``'s answers (:func:`alignment.config.ppo_on_task`); the process reward model for
    ``process_reward``."""

    return ["policy", "critic", "engine", *(["reference"] if cfg.algorithm.kl_coef > 0 else []),
            *([] if ppo_on_task(cfg) else ["reward_model"]),
            *(["process_reward_model"] if process_reward_weight(cfg) else [])]


def prompts_of(cfg, tokenizer, split: str) -> list[list[int]]:
    """Chat-template prompt ids of the dpo_en_demo split, keeping the last ``data.max_prompt_length`` tokens."""

    pairs = load_preference_pairs(split, cfg.data.heldout_size, "dpo_en_demo")
    out = [encode_prompt(tokenizer, p.messages)[-cfg.data.max_prompt_length:] for p in pairs]
    return out[: cfg.data.train_size] if split == "train" else out


def heldout_responses(models, prompts: list[list[int]], cfg) -> dict[str, list[float]]:
    """Greedy responses of the current policy to this DP rank's held-out prompts, scored by the
    reward model: ``{"scores": [...], "lengths": [...]}`` (last pipeline stage's values)."""

    with rollout_phase(models):
        groups = generate_for_group(models.engine, prompts, SamplingConfig(n=1, temperature=0.0,
                                                                           max_tokens=cfg.rollout.max_tokens))
    samples = [g[0] for g in groups]
    scores = reward_model_scores(models, padded_batch(models, samples), cfg)
    return {"scores": scores.tolist(), "lengths": [float(len(s.response_ids)) for s in samples]}


def compare(before: dict, after: dict) -> dict[str, float]:
    """Global win rate of ``after`` over ``before`` (ties count half) and mean score and length
    of both; each DP rank's held-out prompts counted once (collective)."""

    keep = 1.0 if is_output_rank() else 0.0
    sb, sa = torch.tensor(before["scores"]), torch.tensor(after["scores"])
    wins = ((sa > sb).float() + 0.5 * (sa == sb).float()).sum().item()
    n, w, rb, ra, lb, la = all_reduce_sum([keep * v for v in [
        float(len(sb)), wins, sb.sum().item(), sa.sum().item(), sum(before["lengths"]), sum(after["lengths"])]])
    return {"win_rate": w / n, "reward_before": rb / n, "reward_after": ra / n,
            "length_before": lb / n, "length_after": la / n, "prompts": n}


class WinRate:
    """PPO's :class:`alignment.trainers.interfaces.Evaluation`: greedy responses to this DP rank's held-out
    prompts, scored by the reward model, the trained policy's against the initial one's."""

    def __init__(self, cfg, models, prompts: list[list[int]]):
        self.cfg, self.models, self.prompts, self.initial = cfg, models, prompts, None

    def baseline(self) -> None:
        # the initial (SFT) policy's responses: generated before a resume loads trained weights
        # (into the policy, which rollout.backend=megatron runs)
        self.initial = heldout_responses(self.models, self.prompts, self.cfg)

    def before(self, step: int) -> dict[str, float]:  # noqa: ARG002 - the baseline is the "before"
        return {}

    def beside_first_step(self) -> None:  # nothing deferred
        return None

    def measure(self, step: int = 0) -> dict[str, float]:  # noqa: ARG002 - the comparison is with the start
        result = compare(self.initial, heldout_responses(self.models, self.prompts, self.cfg))
        return {f"heldout/{k}": v for k, v in result.items()}

    def final(self) -> tuple[dict[str, float], dict, str]:
        metrics = self.measure()
        result = {k.removeprefix("heldout/"): v for k, v in metrics.items()}
        return metrics, {"heldout": result}, f"held-out (reward model judge): {json.dumps(result)}"


def run(cfg: JobConfig, composed=None) -> dict:
    """Run a PPO job through :mod:`launchers.loop`; returns the summary written to
    ``<output_dir>/summary.json``."""
    from megatron.core import parallel_state as ps

    job = start(cfg, composed)  # validates the config before any process group starts
    models = build_models(cfg, job, roles(cfg))
    if ppo_on_task(cfg):  # data.task's problems, graded by reward.functions' text terms

        train, heldout = training_order(cfg.data, cfg.seed, job.prompts), job.prompts.heldout
        evaluation = HeldoutAccuracy(job, models, heldout)
        request = lambda problems: rl_phases.request(models.tokenizer, problems, cfg)  # noqa: E731
    else:  # dpo_en_demo's chat prompts, judged by the reward model
        train, heldout = prompts_of(cfg, models.tokenizer, "train"), prompts_of(cfg, models.tokenizer, "heldout")
        dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
        evaluation = WinRate(cfg, models, heldout[: len(heldout) // dp * dp][dp_rank::dp])
        request = lambda prompts: ppo.request(prompts, cfg)  # noqa: E731
    spec = JobSpec(
        "ppo", train, lambda items, step, version: ppo.collect(models, items, cfg, version),
        lambda rollout: ppo.train(models, rollout, cfg),
        {"policy": (models.policy, models.optimizer), "critic": (models.critic, models.critic_optimizer)},
        evaluation, request=request)
    return loop.run(job, models, spec)
