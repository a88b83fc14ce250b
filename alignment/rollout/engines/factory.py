"""``rollout.backend``: which :class:`alignment.rollout.base.RolloutEngine` an RL job samples with.

- ``vllm`` (default): a vLLM engine per rank (or per ``rollout.tensor_parallel_size`` ranks) with
  its own copy of the weights in vLLM's layout, fed after every update by the resharder
  (:mod:`parallel.reshard`);
- ``megatron``: Megatron-Core's inference engine on the policy's own model
  (:class:`alignment.rollout.engines.megatron_engine.MegatronEngine`): no second copy of the weights and
  no sync; it also runs where vLLM cannot be installed. Whole-model replicas or tensor parallel
  ones (every rank of a TP group generates the same prompts together, with the same sampling
  stream), and expert-parallel MoE policies at TP = 1; PP = CP = 1 and no sequence parallelism for
  now (:func:`alignment.config.validate` says so before any process group starts).

With ``algorithm.routing_replay=r3`` either engine records the experts a MoE policy routed each token to
(``Sample.routed_experts``), which the trainer replays.
"""

from __future__ import annotations

import json
from pathlib import Path

from alignment.rollout.config import BACKENDS, RolloutConfig
from alignment.rollout.engines.megatron_engine import MegatronEngine
from alignment.rollout.engines.vllm_engine import VLLMEngine


def eos_token_ids(hf_dir: Path, tokenizer) -> list[int]:
    """The token ids that end a response: the HF ``generation_config.json``'s ``eos_token_id``
    (an int or a list, as vLLM reads it) and the tokenizer's."""
    ids = [] if tokenizer.eos_token_id is None else [int(tokenizer.eos_token_id)]
    gen = Path(hf_dir) / "generation_config.json"
    if gen.exists():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        for e in (eos if isinstance(eos, list) else [] if eos is None else [eos]):
            if int(e) not in ids:
                ids.append(int(e))
    return ids


def build_engine(r: RolloutConfig, *, seed: int, dtype: str, hf_dir: Path, policy, vocab_size: int, rank: int,
                 data_parallel_size: int, record_routing: bool = False, steps: int | None = None):
    """This rank's rollout engine for ``rollout.backend`` (``r``: the job's ``rollout`` section).

    Args:
        seed: the job's seed (each engine samples from its own stream derived from it).
        dtype: ``model.dtype``, the engine's weights (vLLM's ``dtype``).
        hf_dir: the HF directory of the initial policy (vLLM loads it; its tokenizer decodes).
        policy: this rank's policy (DDP-wrapped or not); the ``megatron`` backend generates with it.
        vocab_size: the HF config's vocabulary (Megatron pads the model's).
        rank: global rank (seeds each vLLM engine differently; the ``megatron`` backend seeds
            by data-parallel rank, so the ranks of one TP group sample alike).
        data_parallel_size: sizes the ``megatron`` backend's KV cache for one step's rows per rank.
        record_routing: the engine records a MoE policy's routing (``algorithm.routing_replay=r3``).
        steps: the RL steps the run will do (``rollout.enforce_eager=null`` compiles vLLM when they pay a
            cold compile back: :func:`alignment.rollout.engines.compile_cache.choose_enforce_eager`).
    Raises:
        ValueError: an unknown ``rollout.backend``.
    """
    if r.backend == "vllm":
        return VLLMEngine(str(hf_dir), max_model_len=r.max_model_len, kv_cache_gib=r.kv_cache_gib,
                          gpu_memory_utilization=r.gpu_memory_utilization,
                          seed=seed + rank // r.tensor_parallel_size,
                          tensor_parallel_size=r.tensor_parallel_size, enforce_eager=r.enforce_eager,
                          dtype=dtype, steps=steps, record_routing=record_routing)
    if r.backend == "megatron":
        from megatron.core import parallel_state as ps
        from megatron.core.utils import unwrap_model
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(hf_dir)
        rows = max(1, r.prompts_per_step * r.group_size // data_parallel_size)
        return MegatronEngine(unwrap_model(policy), tokenizer, eos_token_id=eos_token_ids(hf_dir, tokenizer),
                              vocab_size=vocab_size, max_model_len=r.max_model_len, max_batch_size=rows,
                              seed=seed + ps.get_data_parallel_rank(), record_routing=record_routing,
                              cuda_graphs=None if r.enforce_eager is None else not r.enforce_eager)
    raise ValueError(f"rollout.backend={r.backend!r}: valid values are {', '.join(BACKENDS)}")
