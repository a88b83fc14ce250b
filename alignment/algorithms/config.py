"""``algorithm``: the algorithm a job runs and its settings, one section class per algorithm (each below
:class:`AlgorithmConfig`, holding that algorithm's keys only; the rollout correction's
:class:`RolloutCorrectionConfig`), and the checks of their own values: the
policy loss (:func:`check_policy_loss`) and the GRPO family's estimators (:func:`check_estimators`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Optional, TypeGuard, TypeVar

from omegaconf import OmegaConf

from alignment.algorithms import hooks
from alignment.algorithms.advantages import ADVANTAGE_ESTIMATORS
from alignment.algorithms.aggregation import AGGREGATION_MODES
from alignment.algorithms.distill_loss import DISTILL_LOSSES, FULL_DISTRIBUTION
from alignment.algorithms.kl import KL_ESTIMATORS
from alignment.algorithms.policy_loss import POLICY_LOSSES
from alignment.algorithms.preference_loss import LOSS_TYPES, REFERENCE_FREE
from alignment.algorithms.rollout_correction import RolloutCorrection
from alignment.schema import ConfigError, plain, ranged, unbounded

WHITEN_LEVELS = ("sequence", "token")
#: ``algorithm.distill_samples`` values
DISTILL_SAMPLES = ("student", "teacher", "dataset")
#: ``algorithm.routing_replay`` values (alignment/training/routing_replay.py)
ROUTING_REPLAY = ("none", "r2", "r3")

_Section = TypeVar("_Section")


@dataclass
class RolloutCorrectionConfig:
    """``algorithm.rollout_correction``: weights from the rollout engine's policy to the trainer's
    (alignment/algorithms/rollout_correction.py; Yao et al. 2025 TIS / MIS). Off by default; the
    mismatch metrics are logged either way."""

    is_level: Optional[str] = None  # null | token | sequence: truncated importance weights min(ratio, is_threshold)
    is_threshold: float = ranged(2.0, 0, low_in=False)  # the cap of the truncated importance weights (TIS)
    mask_level: Optional[str] = None  # null | token | sequence | geometric: zero ratios outside [mask_low, mask_high]
    mask_low: Optional[float] = ranged(None, 0, low_in=False)  # null: 1 / mask_high
    mask_high: float = ranged(2.0, 0, low_in=False)  # ratios above it are masked out (MIS)


@dataclass
class AlgorithmConfig:
    """``algorithm``: the algorithm a job runs (``name``) and its own settings. Every algorithm's section is
    this class or one below it (its record's ``config``: :mod:`alignment.algorithms.registry`), holding that
    algorithm's keys only, so a key of another algorithm's section is no key of this one
    (:mod:`alignment.compose` refuses it, naming whose it is)."""

    # grpo | ppo | rft | online_dpo | distill | sft | rm | dpo | prm, or your own: module.path:Algorithm
    # (alignment/algorithms/registry.py)
    name: str = "grpo"


@dataclass
class OnlineConfig(AlgorithmConfig):
    """The RL jobs' settings (they sample from the policy): DAPO's soft overlong punishment, a reward term
    of every RL job."""

    # DAPO soft overlong punishment interval (tokens); 0 disables
    overlong_buffer_len: int = ranged(0, 0, note=' (tokens; 0: no overlong penalty)')
    overlong_penalty_factor: float = ranged(1.0, 0)  # DAPO: the largest overlong penalty (reward units)


@dataclass
class PolicyGradientConfig(OnlineConfig):
    """The policy-gradient jobs' settings (grpo, ppo, distill): the clipped surrogate, its KL term to the
    reference, the rollout correction, the updates per rollout batch."""

    clip_ratio: float = ranged(0.2, 0, low_in=False)  # lower clip bound (and upper, unless clip_ratio_high is set)
    # DAPO clip-higher, e.g. 0.28
    clip_ratio_high: Optional[float] = ranged(None, 0, low_in=False, note=' (null: clip_ratio)')
    # ppo (clipped surrogate) | gspo (length-normalised sequence ratio, Zheng et al. 2025) | cispo
    # (clipped stop-gradient IS weight, MiniMax-M1 2025) | your own: module.path:function
    # (alignment/algorithms/hooks.py); the clip_ratio* fields bound each one's ratio
    policy_loss: str = "ppo"
    # dual clip of the ppo loss for A < 0 (Ye et al. 2020; verl: 3.0); null: off
    clip_ratio_c: Optional[float] = ranged(None, 1, low_in=False,
                                           note=" (the dual clip, with algorithm.policy_loss=ppo; null: off)")
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
    kl_coef: float = ranged(0.04, 0)  # weight of the KL-to-reference term in the loss; 0: no reference model
    ppo_epochs: int = ranged(1, 1)  # passes over each rollout batch
    num_mini_batches: int = ranged(1, 1)  # optimizer steps per pass


@dataclass
class GRPOFamilyConfig(PolicyGradientConfig):
    """GRPO's step (:mod:`alignment.trainers.grpo`: grpo, distill, and algorithms of your own built on it): the
    KL estimator, loss aggregation, dynamic sampling, routing replay."""

    kl_estimator: str = "k3"  # k1 | k2 | k3 | k3_clamped
    # token-mean | seq-mean-token-sum | seq-mean-token-mean | seq-mean-token-sum-norm (Dr.GRPO)
    loss_agg_mode: str = "token-mean"
    # DAPO: dynamic sampling (drop groups whose rewards are all equal, sample more prompts)
    dynamic_sampling: bool = False
    # dynamic_sampling: rounds of sampling more prompts before training on what is kept
    max_sampling_rounds: int = ranged(3, 1)
    # mixture-of-experts policies: none | r2 (the experts each token took in the old-logprob pass are forced
    # in every update of the batch, so the PPO ratio compares one sub-network; needs ppo_epochs or
    # num_mini_batches > 1) | r3 (the experts the rollout engine routed each token to are forced in every
    # training pass, so the trainer runs the sub-network that sampled; either engine records them, vLLM's
    # inside the engine, which then runs eager; not for episodes played by agents). moe/routing_agreement: the share of (token, layer) pairs whose own experts in
    # training equal the rollout's (r3) or the old pass's (r2; none with several updates)
    routing_replay: str = "none"


@dataclass
class GroupAdvantageConfig(GRPOFamilyConfig):
    """GRPO's step with a group advantage estimator by name (grpo, distill)."""

    # grpo | grpo_no_std (Dr.GRPO) | rloo | reinforce_plus_plus | reinforce_plus_plus_baseline | your own:
    # module.path:function (alignment/algorithms/hooks.py)
    advantage_estimator: str = "grpo"
    # reinforce_plus_plus[_baseline]: whiten over each response once (sequence) or every valid token
    # (token: long responses weigh more, as verl / OpenRLHF); global batch either way
    whiten_level: str = "sequence"


@dataclass
class GRPOConfig(GroupAdvantageConfig):
    """``algorithm.name=grpo`` and its variants (Dr.GRPO, DAPO, RLOO, REINFORCE++, GSPO, CISPO)."""

    step_separator: str = "\n"  # with a process_reward term: what ends a step


@dataclass
class DistillConfig(GroupAdvantageConfig):
    """``algorithm.name=distill``: on-policy distillation (the student samples, model.teacher_path scores
    its tokens)."""

    # reverse_kl (each token's teacher-minus-student logprob is its advantage, the policy-gradient loss) |
    # jsd (GKD's generalized Jensen-Shannon divergence of the whole distributions, minimised) |
    # forward_kl (KL(teacher || student) of the whole distributions: jsd at distill_beta=0)
    distill_loss: str = "reverse_kl"
    distill_beta: float = ranged(0.5, 0, 1, high_in=True)  # jsd: GKD's beta (0: forward KL, 1: reverse KL)
    # weight of the task's group-normalised reward advantages (reward.functions) beside the distillation
    # term; 0: distillation only (the rewards are still computed and logged)
    task_reward_weight: float = ranged(0.0, 0)
    # who samples the responses the student trains on: student (on-policy) | teacher (the teacher generates
    # with Megatron's engine on its own shards; off-policy KD, jsd or forward_kl only) | dataset (each
    # prompt's answer in the data.response_key column of data.train_files; off-policy KD on a dataset, jsd
    # or forward_kl only, rollout.group_size=1)
    distill_samples: str = "student"


@dataclass
class PPOConfig(PolicyGradientConfig):
    """``algorithm.name=ppo``: GAE with a critic."""

    gamma: float = ranged(1.0, 0, 1, high_in=True)  # the discount (GAE's gamma)
    gae_lambda: float = ranged(0.95, 0, 1, high_in=True)  # GAE's lambda
    value_clip: Optional[float] = ranged(0.2, 0)  # critic value clipping half-width; null disables
    # stop this step's remaining epochs / mini-batches once the policy's approximate KL from the sampling
    # policy exceeds 1.5 x target_kl (OpenAI Spinning Up's PPO); null: run them all
    target_kl: Optional[float] = ranged(None, 0, low_in=False, note=' (null: no early stop)')
    whiten_advantages: bool = True  # normalise the GAE advantages over the batch
    step_separator: str = "\n"  # with a process_reward term: what ends a step


@dataclass
class PreferenceConfig(AlgorithmConfig):
    """``algorithm.name=dpo``: a preference loss on chosen / rejected pairs."""

    # sigmoid (DPO; cDPO with label_smoothing) | ipo | hinge | kto | simpo | orpo
    loss_type: str = "sigmoid"
    beta: float = ranged(0.1, 0, low_in=False)  # the preference loss's inverse temperature (DPO's beta)
    label_smoothing: float = ranged(0.0, 0, 0.5)  # sigmoid: the chance a label is flipped (cDPO)
    simpo_gamma: float = ranged(0.5, 0)  # simpo: the target reward margin (SimPO's gamma)
    orpo_lambda: float = ranged(0.1, 0)  # orpo: weight of the odds-ratio term beside the SFT loss


@dataclass
class OnlineDPOConfig(PreferenceConfig, OnlineConfig):
    """``algorithm.name=online_dpo``: a preference loss on the best and worst of the policy's samples."""

    # the DPO reference is the initial policy (initial) or, every iteration_steps steps, the policy of that
    # moment (iteration: iterative DPO, Xu et al. 2023; checkpointed with the policy)
    ref_update: str = "initial"  # initial | iteration
    iteration_steps: int = ranged(4, 1)  # with ref_update=iteration: steps per iteration


@dataclass
class RFTConfig(OnlineConfig):
    """``algorithm.name=rft`` (rejection-sampling fine-tuning / STaR): keep samples whose reward >=
    accept_threshold, only distinct responses per problem (dedup_responses); rationalize: retry unsolved
    problems with the answer as a hint, trained on without it (STaR's rationalisation)."""

    accept_threshold: float = unbounded(1.0)  # the lowest reward of a kept sample
    dedup_responses: bool = True  # keep distinct responses only, per problem
    rationalize: bool = False  # retry unsolved problems with the answer as a hint (STaR)


@dataclass
class SFTConfig(AlgorithmConfig):
    """``algorithm.name=sft``: supervised fine-tuning has no settings of its own here."""


@dataclass
class RewardModelConfig(AlgorithmConfig):
    """``algorithm.name=rm``: a Bradley-Terry reward model."""

    center_coef: float = ranged(0.0, 0)  # reward-centering weight (Eisenstein et al. 2023)


@dataclass
class ProcessRewardConfig(AlgorithmConfig):
    """``algorithm.name=prm``: the scalar head scored at the end of every step (steps end at step_separator),
    trained on each step's label (process) or, as an outcome reward model, only on the final answer's
    correctness at the last step (outcome; Lightman et al. 2023's ORM, same data)."""

    step_separator: str = "\n"  # what ends a step
    supervision: str = "process"  # process (every step's label) | outcome (the answer, at the last step)


def section_keys(cls: type) -> tuple[str, ...]:
    """The top-level keys of the algorithm section ``cls`` (a subclass of :class:`AlgorithmConfig`)."""
    return tuple(f.name for f in dataclasses.fields(cls))


def has_section(a: object, cls: type[_Section]) -> TypeGuard[_Section]:
    """Whether the algorithm section ``a`` (a dataclass, or a composed ``DictConfig`` typed by one) is a
    ``cls`` (has its keys)."""
    kind = OmegaConf.get_type(a) if OmegaConf.is_config(a) else type(a)
    return isinstance(kind, type) and issubclass(kind, cls)


def reference_policy(a: Any) -> bool:
    """Whether the RL algorithm of section ``a`` trains against a frozen reference policy: a policy gradient
    for its KL term (``kl_coef > 0``), online DPO for the losses that use one (all but ``simpo`` / ``orpo``)."""
    if has_section(a, PolicyGradientConfig):
        return bool(a.kl_coef > 0)
    return has_section(a, OnlineDPOConfig) and a.loss_type not in REFERENCE_FREE


def routing_replay(a: Any) -> str:
    """The section ``a``'s ``routing_replay`` (none | r2 | r3); ``none`` for an algorithm without it."""
    return str(a.routing_replay) if has_section(a, GRPOFamilyConfig) else "none"


def check_policy_loss(a: PolicyGradientConfig) -> None:
    """RL jobs: the policy loss, its dual clip and the rollout correction.

    Raises:
        ConfigError: naming the field and its valid values.
    """
    if hooks.is_import_path(a.policy_loss):
        hooks.policy_loss(a.policy_loss)  # imported and called on a probe: its contract kept
    elif a.policy_loss not in POLICY_LOSSES:
        raise ConfigError(f"algorithm.policy_loss={a.policy_loss!r}: valid values are {', '.join(POLICY_LOSSES)}, "
                          "or your own as module.path:function")
    if a.clip_ratio_c is not None and a.policy_loss != "ppo":
        raise ConfigError(f"algorithm.clip_ratio_c={a.clip_ratio_c}: the dual clip needs algorithm.policy_loss=ppo "
                          f"(it is {a.policy_loss}), or null")
    try:
        RolloutCorrection(**plain(a.rollout_correction))
    except ValueError as e:
        raise ConfigError(f"algorithm.rollout_correction.{e}") from e


def check_estimators(a: GRPOFamilyConfig) -> None:
    """GRPO's step: a KL estimator and a loss aggregation that exist; with a group advantage estimator by name
    (:class:`GroupAdvantageConfig`), one that exists (``gae`` needs PPO's critic) and a whitening level.

    Raises:
        ConfigError: naming the field and its valid values.
    """
    if a.kl_estimator not in KL_ESTIMATORS:
        raise ConfigError(f"algorithm.kl_estimator={a.kl_estimator!r}: valid values are {', '.join(KL_ESTIMATORS)}")
    if has_section(a, GroupAdvantageConfig):
        _check_group_advantages(a)
    if a.loss_agg_mode not in AGGREGATION_MODES:
        raise ConfigError(f"algorithm.loss_agg_mode={a.loss_agg_mode!r}: valid values are {', '.join(AGGREGATION_MODES)}")


def _check_group_advantages(a: GroupAdvantageConfig) -> None:
    group_estimators = [k for k in ADVANTAGE_ESTIMATORS if k != "gae"]  # gae needs a critic (PPO)
    if hooks.is_import_path(a.advantage_estimator):
        hooks.advantage_estimator(a.advantage_estimator)  # imported and called on a probe: its contract kept
    elif a.advantage_estimator not in group_estimators:
        raise ConfigError(f"algorithm.advantage_estimator={a.advantage_estimator!r}: valid values are "
                          f"{', '.join(group_estimators)}, or your own as module.path:function")
    if a.whiten_level not in WHITEN_LEVELS:
        raise ConfigError(f"algorithm.whiten_level={a.whiten_level!r}: valid values are sequence, token (the "
                          "units REINFORCE++ whitens its advantages over)")


def check_distill(a: DistillConfig) -> None:
    """``algorithm.name=distill``: a distillation loss that exists.

    Raises:
        ConfigError: naming the field and its valid values.
    """
    if a.distill_loss not in DISTILL_LOSSES:
        raise ConfigError(f"algorithm.distill_loss={a.distill_loss!r}: valid values are {', '.join(DISTILL_LOSSES)}")
    if a.distill_samples not in DISTILL_SAMPLES:
        raise ConfigError(f"algorithm.distill_samples={a.distill_samples!r}: valid values are "
                          f"{', '.join(DISTILL_SAMPLES)}")
    if a.distill_samples == "student":
        return
    whose = {"teacher": "the teacher's answers", "dataset": "the dataset's answers"}[a.distill_samples]
    if a.distill_loss not in FULL_DISTRIBUTION:
        raise ConfigError(f"algorithm.distill_samples={a.distill_samples} trains on {whose}, but "
                          f"algorithm.distill_loss={a.distill_loss} is an on-policy loss (the student's own samples); "
                          "set algorithm.distill_loss=forward_kl (or jsd)")
    if a.task_reward_weight:
        raise ConfigError(f"algorithm.task_reward_weight={a.task_reward_weight} would train the student by policy "
                          f"gradient on {whose}; set it to 0 with algorithm.distill_samples={a.distill_samples}")
    correction = a.rollout_correction
    if correction.is_level or correction.mask_level:
        raise ConfigError(f"algorithm.rollout_correction weighs tokens by the student's own sampling policy, but with "
                          f"algorithm.distill_samples={a.distill_samples} the student did not sample them ({whose}); "
                          "set algorithm.rollout_correction.is_level and mask_level to null")


def check_loss_type(a: PreferenceConfig) -> None:
    """The DPO family (dpo, online_dpo): a preference loss that exists.

    Raises:
        ConfigError: naming the field and its valid values.
    """
    if a.loss_type not in LOSS_TYPES:
        raise ConfigError(f"algorithm.loss_type={a.loss_type!r}: valid values are {', '.join(LOSS_TYPES)}")
