"""Memory per GPU of a training layout (and of a colocated vLLM engine), in bytes.

Pure functions of a ``ModelDims``-style model (:class:`alignment.models.dims.ModelDims`) and a
:class:`parallel.layout.ParallelLayout`; no process groups, no tensors. What is counted is
what megalign's training path allocates (Megatron-Core 0.16.1 DDP and optimizer, the local
layer spec with :mod:`parallel.attention`, :class:`alignment.training.megatron_step.LogprobOutputs`):

* **weights**: the parameters of the largest pipeline stage, this TP rank's shard; in
  mixture-of-experts layers the replicated router and this expert-parallel rank's experts
  (``E / EP``, each split over expert TP).
* **grads**: Megatron DDP's contiguous gradient buffer. megalign builds DDP with
  ``grad_reduce_in_fp32=True`` (``megatron_step.setup_training``), so ``main_grad`` is fp32
  (4 bytes/param) whatever the weights' dtype (``distributed_data_parallel.py``:
  ``grad_dtype = torch.float if grad_reduce_in_fp32 else param.dtype``). Plus one transient
  gradient of the stage's largest weight in the weights' dtype: megalign runs without
  ``gradient_accumulation_fusion``, so autograd allocates ``param.grad`` before DDP's hook adds
  it into ``main_grad`` and frees it.
* **optimizer**: Adam ``exp_avg`` + ``exp_avg_sq`` in fp32 (8 bytes/param), plus an fp32 master
  copy for bf16 weights (``Float16OptimizerWithFloat16Params``; fp32 weights are their own
  master, ``FP32Optimizer``): 8 or 12 bytes/param, divided by DP x CP with the distributed
  optimizer (it shards over the data-parallel-with-context group; for fp32 weights the master
  shard is a view of the parameter buffer, ``distrib_optimizer.py``); expert parameters are
  sharded over the expert-data-parallel group instead (world / (expert TP x EP x PP)). This is the table of the
  Megatron-LM distributed-optimizer docs: bf16 18 -> 6 + 12/d bytes/param, fp32 16 -> 8 + 8/d.
  Its padding (each bucket to a multiple of lcm(d, 128) elements, each parameter to 64) is
  ignored: under 64 elements per parameter.
* **activations**: what autograd keeps for the backward pass, per layer (see
  :func:`layer_activation_bytes`; MoE layers :func:`moe_activation_bytes`, balanced routing
  assumed), times the layers of one stage, times the micro-batches in flight on it under 1F1B
  (:func:`microbatches_in_flight`).
* **logits**: ``[s, b, vocab/TP]`` logits of the one micro-batch at the loss
  (:func:`logits_bytes`): often the largest single term for small models.
* **rollout_weights**, **kv_cache**: a colocated vLLM engine's own copy of the weights and its
  KV cache (:func:`kv_cache_bytes`), when one is planned.

Not counted: the CUDA context, NCCL buffers and allocator fragmentation (leave a reserve),
torch's foreach/fused-Adam temporaries, activation recomputation (megalign does not recompute).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from parallel.layout import ParallelLayout
from parallel.lora import is_target
from parallel.vocab_logprobs import chunk_tokens

DTYPE_BYTES = {"float32": 4, "bfloat16": 2}
GiB = 1024**3


def dtype_bytes(dtype: str) -> int:
    """Bytes per element of ``dtype`` (``model.dtype`` values). Raises ValueError for others."""
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype={dtype!r}: valid values are {', '.join(DTYPE_BYTES)}")
    return DTYPE_BYTES[dtype]


# ---- parameters -----------------------------------------------------------------------------

def layer_parameters(dims, tp: int, *, moe: bool = False, ep: int = 1, etp: int | None = None) -> int:
    """Parameters of one transformer layer on one TP rank (elements).

    ``linear_qkv`` ``[(nq + 2 nkv) hd / tp, H]`` (+ its bias for Qwen2), ``linear_proj``
    ``[H, nq hd / tp]``, the two RMSNorm weights ``[H]`` and Qwen3's QK-norms ``[hd]``
    (replicated over TP); then a dense MLP, ``linear_fc1`` ``[2 F / tp, H]`` (gate and up) and
    ``linear_fc2`` ``[H, F / tp]``, or for an MoE layer (``moe``) the router ``[E, H]``
    (replicated) and this rank's ``E / ep`` experts of ``3 F_e H / etp`` each
    (:func:`expert_parameters`; ``etp`` defaults to ``tp``, as Megatron's).
    """
    d = dims
    qkv_out = (d.num_attention_heads + 2 * d.num_query_groups) * d.head_dim // tp
    attention = (qkv_out * d.hidden_size + (qkv_out if d.qkv_bias else 0)
                 + d.hidden_size * d.num_attention_heads * d.head_dim // tp
                 + 2 * d.hidden_size + (2 * d.head_dim if d.qk_layernorm else 0))
    if moe:
        return attention + d.num_experts * d.hidden_size + expert_parameters(dims, ep, etp or tp)
    return attention + 3 * d.ffn_hidden_size * d.hidden_size // tp


def lora_layer_parameters(dims, tp: int, rank: int, targets=("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"),
                          *, moe: bool = False, ep: int = 1, etp: int | None = None, experts_only: bool = False) -> int:
    """LoRA adapter parameters of one layer on one TP rank (elements; :mod:`parallel.lora`):
    column-parallel ``linear_qkv`` / ``linear_fc1`` hold ``A [r, H]`` whole and ``B [out / tp, r]``,
    row-parallel ``linear_proj`` / ``linear_fc2`` hold ``A [r, in / tp]`` and ``B [H, r]`` whole.
    An MoE layer (``moe``) has the same per expert on its ``E / ep`` local experts, split over
    expert TP ``etp`` (default ``tp``) with the expert width ``F_e``. ``targets``: as
    ``model.lora.target_modules`` (``linear_fc1`` every MLP, ``mlp.`` dense, ``experts.`` experts).
    ``experts_only``: count the experts' adapters alone."""
    d, r, h = dims, rank, dims.hidden_size
    sizes = {"linear_qkv": r * h + (d.num_attention_heads + 2 * d.num_query_groups) * d.head_dim // tp * r,
             "linear_proj": r * d.num_attention_heads * d.head_dim // tp + h * r}
    if moe:
        et, f = etp or tp, d.moe_ffn_hidden_size
        per_expert = {"linear_fc1": r * h + 2 * f // et * r, "linear_fc2": r * f // et + h * r}
        sizes.update({k: d.num_experts // ep * v for k, v in per_expert.items()})
    else:
        sizes.update({"linear_fc1": r * h + 2 * d.ffn_hidden_size // tp * r,
                      "linear_fc2": r * d.ffn_hidden_size // tp + h * r})

    mlp = "mlp.experts." if moe else "mlp."
    names = {"linear_fc1": mlp + "linear_fc1", "linear_fc2": mlp + "linear_fc2"}
    if not experts_only:
        names.update(linear_qkv="self_attention.linear_qkv", linear_proj="self_attention.linear_proj")
    elif not moe:
        return 0
    return sum(sizes[leaf] for leaf, name in names.items() if is_target(name, targets))


def expert_parameters(dims, ep: int, etp: int) -> int:
    """This rank's expert parameters in one MoE layer: ``E / ep`` experts, each ``linear_fc1``
    ``[2 F_e / etp, H]`` + ``linear_fc2`` ``[H, F_e / etp]`` (Megatron's ``SequentialMLP``)."""
    return dims.num_experts // ep * 3 * dims.moe_ffn_hidden_size * dims.hidden_size // etp


def stage_layers(dims, pp: int, stage: int, vpp: int | None = None) -> list[int]:
    """Global indices of the layers pipeline rank ``stage`` holds: with ``vpp`` model chunks per
    rank, chunk ``v`` holds layers ``[(v pp + stage) c, (v pp + stage + 1) c)`` with
    ``c = L / (pp vpp)`` (Megatron's interleaved assignment); without, one contiguous block."""
    v = vpp or 1
    c = dims.num_layers // (pp * v)
    return [i for chunk in range(v) for i in range((chunk * pp + stage) * c, (chunk * pp + stage + 1) * c)]


def _is_moe(dims, layer: int) -> bool:
    return bool(getattr(dims, "num_experts", 0)) and bool(dims.moe_layer_pattern[layer])


def stage_parameters(dims, tp: int, pp: int, stage: int, *, ep: int = 1, etp: int | None = None,
                     vpp: int | None = None) -> int:
    """Parameters held by pipeline rank ``stage`` (0-based) on one TP rank (elements).

    Every stage holds ``num_layers / pp`` layers (with virtual PP, its chunks together hold the
    same; which ones matters only for a mix of dense and MoE layers, :func:`stage_layers`). The
    first stage adds the word embedding ``[V_pad / tp, H]``; the last stage the final
    norm ``[H]`` and the output layer ``[V_pad / tp, H]``, except when the embeddings are tied
    and ``pp == 1`` (one tensor serves both). With tied embeddings and ``pp > 1`` the last stage
    keeps its own copy, as Megatron does (``shared_embedding``, kept equal by an all-reduce of
    the gradients between the first and last stage). ``V_pad``: ``dims.padded_vocab_size``.
    ``ep`` / ``etp``: expert (tensor) parallel sizes for MoE layers.
    Raises ValueError for ``stage`` outside ``[0, pp)``.
    """
    if not 0 <= stage < pp:
        raise ValueError(f"stage={stage}: must be in [0, {pp})")
    n = sum(layer_parameters(dims, tp, moe=_is_moe(dims, i), ep=ep, etp=etp)
            for i in stage_layers(dims, pp, stage, vpp))
    vocab_shard = dims.padded_vocab_size(tp) // tp * dims.hidden_size
    if stage == 0:
        n += vocab_shard
    if stage == pp - 1:
        n += dims.hidden_size
        if not (dims.tie_word_embeddings and pp == 1):
            n += vocab_shard
    return n


def stage_expert_parameters(dims, pp: int, stage: int, *, ep: int, etp: int, vpp: int | None = None) -> int:
    """The expert part of :func:`stage_parameters`: what the distributed optimizer shards over the
    expert-data-parallel group instead of data parallel x context parallel."""
    return sum(expert_parameters(dims, ep, etp) for i in stage_layers(dims, pp, stage, vpp) if _is_moe(dims, i))


def largest_weight(dims, tp: int, pp: int, stage: int, etp: int | None = None) -> int:
    """Elements of the stage's largest single weight (its transient gradient, see module doc)."""
    d = dims
    biggest = max(2 * d.ffn_hidden_size * d.hidden_size // tp,
                  (d.num_attention_heads + 2 * d.num_query_groups) * d.head_dim // tp * d.hidden_size)
    if getattr(d, "num_experts", 0):
        biggest = max(biggest, 2 * d.moe_ffn_hidden_size * d.hidden_size // (etp or tp), d.num_experts * d.hidden_size)
    if stage == 0 or stage == pp - 1:
        biggest = max(biggest, d.padded_vocab_size(tp) // tp * d.hidden_size)
    return biggest


def optimizer_bytes_per_param(dtype: str) -> int:
    """Adam state per parameter: fp32 ``exp_avg`` and ``exp_avg_sq`` (8), plus an fp32 master
    copy (4) when the weights are not fp32."""
    return 8 + (4 if dtype_bytes(dtype) != 4 else 0)


def checkpoint_bytes(dims, *, dtype: str, optimizer: bool = True, lora_rank: int = 0,
                     lora_targets=("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")) -> int:
    """Bytes of one model's checkpoint (Megatron's ``torch_dist``, written once whatever the layout:
    the parameters at TP = PP = 1) in ``dtype``, with Adam's state (:func:`optimizer_bytes_per_param`)
    when ``optimizer``; with LoRA (``lora_rank`` > 0) only the adapters and their state, the frozen
    base being the model's own files. An estimate: metadata and per-file overhead are left out
    (a few kB).

    Raises:
        ValueError: an unknown ``dtype``.
    """
    per = dtype_bytes(dtype) + (optimizer_bytes_per_param(dtype) if optimizer else 0)
    if lora_rank:
        params = sum(lora_layer_parameters(dims, 1, lora_rank, lora_targets, moe=_is_moe(dims, i))
                     for i in range(dims.num_layers))
    else:
        params = stage_parameters(dims, 1, 1, 0)
    return params * per


# ---- activations ----------------------------------------------------------------------------

def layer_activation_bytes(dims, tokens: int, tp: int, sequence_parallel: bool, dtype: str, *, moe: bool = False,
                           etp: int | None = None) -> int:
    """Bytes autograd keeps for one layer's backward, for ``tokens`` tokens on this rank
    (``micro_batch_size * seq_length / cp``).

    Adapted from Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
    Transformer Models" (arXiv:2205.05198), Sec. 4: ``sbh (34 + 5 a s / h)`` bytes per layer
    with 16-bit activations, ``/ t`` with tensor + sequence parallelism (their eq. 5), and
    ``sbh (10 + 24 / t + 5 a s / (h t))`` with TP alone (eq. 4: norms and the inputs of the
    first linear layers stay replicated). Their count is for GPT (LayerNorm, GeLU MLP, dropout,
    multi-head attention that stores the ``a s^2`` softmax). megalign's layer (Megatron's local
    spec) differs, and the count below is what autograd's saved tensors hold in it (checked
    tensor by tensor with ``torch.autograd`` graph inspection on a 1-layer model), in elements
    per token (``H`` hidden, ``hd`` head dim, ``nq``/``nkv`` query/KV heads, ``F`` MLP size):

    * each RMSNorm (two): its input, the normalised input (for the weight's gradient) and its
      output = the next linear layer's input: ``3 H`` each, ``6 H``;
    * attention: the QKV projection output ``(nq + 2 nkv) hd`` (``v`` is a view of it), the
      RoPE'd ``q`` ``nq hd`` and ``k`` ``nkv hd``, the attention output ``nq hd`` (also
      ``linear_proj``'s input), the softmax log-sum-exp ``nq`` in fp32. Flash attention
      (``scaled_dot_product_attention``, ring attention) keeps no ``s x s`` probabilities, so
      Korthikanti's ``5 a s / h`` term is gone (Dao et al. 2022, FlashAttention);
    * SwiGLU MLP: the ``linear_fc1`` output ``2 F``, ``silu(gate)`` ``F``, a copy of ``up``
      ``F`` and ``linear_fc2``'s input ``F``: ``5 F``.

    No dropout (megalign sets it to 0), so no masks. With tensor parallelism everything but the
    norm terms is divided by ``tp``; with sequence parallelism the norm terms too (the linear
    layers keep their sequence-split input and gather it again in backward). An MoE layer
    (``moe``) has :func:`moe_activation_bytes` instead of the MLP term.
    """
    d, b = dims, dtype_bytes(dtype)
    norm = 6 * d.hidden_size / (tp if sequence_parallel else 1)
    attn = ((d.num_attention_heads + 2 * d.num_query_groups) * d.head_dim
            + d.num_attention_heads * d.head_dim + d.num_query_groups * d.head_dim
            + d.num_attention_heads * d.head_dim) / tp
    lse = 4 * d.num_attention_heads / tp  # fp32 whatever the dtype
    if moe:
        return int(tokens * ((norm + attn) * b + lse)) + moe_activation_bytes(dims, tokens, tp, sequence_parallel,
                                                                              dtype, etp or tp)
    mlp = 5 * d.ffn_hidden_size / tp
    return int(tokens * ((norm + attn + mlp) * b + lse))


def moe_activation_bytes(dims, tokens: int, tp: int, sequence_parallel: bool, dtype: str, etp: int) -> int:
    """Bytes an MoE layer's router and experts keep for backward, assuming balanced routing.

    Each rank routes its own tokens (``tokens / tp`` with sequence parallelism): the router keeps
    its fp32 logits, probabilities and the aux loss's scores (``3 E`` x 4 bytes per token). The
    ``alltoall`` dispatcher then gathers the tokens of the expert-TP group (``x etp``) and sends
    each token's ``topk`` copies to the experts' ranks; balanced, every rank receives as many
    (token, expert) pairs as its tokens send, and keeps per pair the expert's input ``H`` and the
    SwiGLU terms ``5 F_e / etp`` (as a dense MLP, :func:`layer_activation_bytes`)."""
    d, b = dims, dtype_bytes(dtype)
    routed = tokens / (tp if sequence_parallel else 1)
    pairs = routed * etp * d.moe_router_topk
    return int(routed * 3 * d.num_experts * 4 + pairs * (d.hidden_size + 5 * d.moe_ffn_hidden_size / etp) * b)


def microbatches_in_flight(pp: int, stage: int, num_microbatches: int | None = None,
                           vpp: int | None = None) -> int:
    """Model chunks x micro-batches whose activations pipeline rank ``stage`` holds at its peak.

    1F1B (Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU
    Clusters Using Megatron-LM", Sec. 2.2.1): rank ``r`` runs ``pp - r - 1`` warm-up forwards,
    so it holds ``min(pp - r, m)`` micro-batches; the first stage holds ``pp``, i.e. as much
    as one micro-batch through all layers (Korthikanti et al. 2022, Sec. 4.2.3). Interleaved
    (``vpp`` chunks per rank, Megatron's ``get_forward_backward_func``): warm-up
    ``(pp - r - 1) * 2 + (vpp - 1) * pp`` chunk-forwards, capped by ``m * vpp``; on the first
    stage that is ``L (1 + (pp - 1) / (pp vpp))`` layers' worth (Korthikanti Sec. 4.2.3).
    ``num_microbatches=None`` assumes enough micro-batches to fill the pipeline.
    """
    if pp == 1:
        return 1
    v = vpp or 1
    warmup = (pp - stage - 1) * (2 if v > 1 else 1) + (v - 1) * pp
    return warmup + 1 if num_microbatches is None else min(warmup + 1, num_microbatches * v)


def logits_bytes(dims, tokens: int, tp: int, dtype: str) -> int:
    """Peak bytes of the ``[tokens, V_pad / tp]`` logits of one micro-batch at the loss.

    :func:`parallel.vocab_logprobs.vocab_parallel_logprobs` keeps the model's logits (weights'
    dtype) for backward and writes their gradient in the same dtype while they are alive; its
    fp32 working set is two ``[chunk, V_pad / tp]`` tensors (the upcast chunk and its
    exponentials), ``chunk`` = :func:`parallel.vocab_logprobs.chunk_tokens` tokens at most.
    So ``2 x dtype bytes`` per entry plus ``2 x 4`` bytes per entry of one chunk.
    """

    v_local = dims.padded_vocab_size(tp) // tp
    working = 2 * 4 * min(tokens, chunk_tokens(v_local)) * v_local
    return 2 * dtype_bytes(dtype) * tokens * v_local + working


# ---- vLLM -------------------------------------------------------------------------------------

def kv_cache_bytes(dims, tokens: int, rollout_tp: int, dtype: str) -> int:
    """vLLM's paged KV cache for ``tokens`` tokens on one GPU of a ``rollout_tp`` engine:
    ``2 (K and V) x layers x kv_heads_per_rank x head_dim x bytes x tokens``. vLLM replicates
    the KV heads when ``rollout_tp > nkv`` (``max(1, nkv / tp)`` heads per rank)."""
    heads = max(1, dims.num_query_groups // rollout_tp)
    return 2 * dims.num_layers * heads * dims.head_dim * dtype_bytes(dtype) * tokens


def rollout_weight_bytes(dims, rollout_tp: int, dtype: str) -> int:
    """The vLLM engine's own copy of the weights on one GPU (colocated with the trainer):
    every layer and the vocabulary split ``rollout_tp`` ways (vLLM pads the vocabulary to 64);
    replicated KV heads when ``rollout_tp > nkv``; MoE layers hold every expert, each split
    ``rollout_tp`` ways (vLLM's fused MoE without expert parallelism), and the router."""
    d = dims
    kv = max(1, d.num_query_groups // rollout_tp)
    qkv = (d.num_attention_heads // rollout_tp + 2 * kv) * d.head_dim
    attention = (qkv * d.hidden_size + (qkv if d.qkv_bias else 0) + d.num_attention_heads * d.head_dim // rollout_tp
                 * d.hidden_size + 2 * d.hidden_size + (2 * d.head_dim if d.qk_layernorm else 0))
    dense = 3 * d.ffn_hidden_size // rollout_tp * d.hidden_size
    moe = (d.num_experts * d.hidden_size + d.num_experts * 3 * d.moe_ffn_hidden_size // rollout_tp * d.hidden_size
           if getattr(d, "num_experts", 0) else 0)
    layers = sum(attention + (moe if _is_moe(d, i) else dense) for i in range(d.num_layers))
    vocab = -(-d.vocab_size // 64) * 64 // rollout_tp * d.hidden_size
    return (layers + vocab * (1 if d.tie_word_embeddings else 2) + d.hidden_size) * dtype_bytes(dtype)


@dataclass(frozen=True)
class RolloutPlan:
    """A colocated vLLM engine: its TP size, the KV-cache tokens it holds per engine (e.g.
    ``max_model_len x`` concurrent sequences) and its dtype."""

    tensor_parallel_size: int = 1
    kv_cache_tokens: int = 0
    dtype: str = "bfloat16"


# ---- the whole estimate -----------------------------------------------------------------------

@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes per GPU on pipeline rank ``stage`` (the largest one, from :func:`estimate_memory`).

    ``optimizer`` is the Adam state for the chosen setting; ``optimizer_plain`` /
    ``optimizer_distributed`` give both settings."""

    stage: int
    weights: int
    grads: int
    optimizer: int
    optimizer_plain: int
    optimizer_distributed: int
    activations: int
    logits: int
    rollout_weights: int = 0
    kv_cache: int = 0

    @property
    def total(self) -> int:
        """Bytes per GPU: weights + grads + optimizer + activations + logits + vLLM."""
        return (self.weights + self.grads + self.optimizer + self.activations + self.logits
                + self.rollout_weights + self.kv_cache)

    def as_dict(self) -> dict[str, int]:
        """Every field and ``total``, in bytes."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["total"] = self.total
        return out


def stage_memory(dims, layout: ParallelLayout, stage: int, *, dtype: str, micro_batch_size: int, seq_length: int,
                 distributed_optimizer: bool, num_microbatches: int | None = None,
                 rollout: RolloutPlan | None = None, lora_rank: int = 0) -> MemoryBreakdown:
    """:class:`MemoryBreakdown` of pipeline rank ``stage`` (see :func:`estimate_memory`)."""
    tp, pp, cp = layout.tensor_model_parallel_size, layout.pipeline_model_parallel_size, layout.context_parallel_size
    vpp = layout.virtual_pipeline_model_parallel_size
    ep, etp = layout.expert_model_parallel_size, layout.expert_tensor_size
    shard = layout.data_parallel_size * cp
    n = stage_parameters(dims, tp, pp, stage, ep=ep, etp=etp, vpp=vpp)
    experts = stage_expert_parameters(dims, pp, stage, ep=ep, etp=etp, vpp=vpp)
    b = dtype_bytes(dtype)
    tokens = micro_batch_size * seq_length // cp
    per_adam = optimizer_bytes_per_param(dtype)
    # the distributed optimizer shards dense state over DP x CP, expert state over expert DP
    plain = n * per_adam
    dist = -(-(n - experts) * per_adam // shard) + -(-experts * per_adam // layout.expert_data_parallel_size)
    acts = sum(layer_activation_bytes(dims, tokens, tp, layout.sequence_parallel, dtype, moe=_is_moe(dims, i), etp=etp)
               for i in stage_layers(dims, pp, stage, vpp)) // (vpp or 1)
    acts *= microbatches_in_flight(pp, stage, num_microbatches, vpp)
    if stage < pp - 1:  # each in-flight micro-batch's stage output, kept by the schedule for backward
        acts += microbatches_in_flight(pp, stage, num_microbatches, vpp) * tokens * dims.hidden_size * b \
            // (tp if layout.sequence_parallel else 1)
    logits = 0
    if stage == pp - 1:  # final norm (3 H per token, as a layer's norm) + the logits
        acts += 3 * tokens * dims.hidden_size * b // (tp if layout.sequence_parallel else 1)
        logits = logits_bytes(dims, tokens, tp, dtype)
    weights, grads = n * b, n * 4 + largest_weight(dims, tp, pp, stage, etp) * b
    if lora_rank:  # frozen base: gradients and Adam state for the adapters only (experts' over expert DP)
        a, a_exp = (sum(lora_layer_parameters(dims, tp, lora_rank, moe=_is_moe(dims, i), ep=ep, etp=etp, experts_only=x)
                        for i in stage_layers(dims, pp, stage, vpp)) for x in (False, True))
        weights, grads = (n + a) * b, a * (4 + b)
        plain = a * per_adam
        dist = -(-(a - a_exp) * per_adam // shard) + -(-a_exp * per_adam // layout.expert_data_parallel_size)
    rw = kv = 0
    if rollout is not None:
        rw = rollout_weight_bytes(dims, rollout.tensor_parallel_size, rollout.dtype)
        kv = kv_cache_bytes(dims, rollout.kv_cache_tokens, rollout.tensor_parallel_size, rollout.dtype)
    return MemoryBreakdown(stage=stage, weights=weights, grads=grads,
                           optimizer=dist if distributed_optimizer else plain, optimizer_plain=plain,
                           optimizer_distributed=dist, activations=acts, logits=logits,
                           rollout_weights=rw, kv_cache=kv)


def estimate_memory(dims, layout: ParallelLayout, *, dtype: str = "bfloat16", micro_batch_size: int = 1,
                    seq_length: int = 4096, distributed_optimizer: bool = False,
                    num_microbatches: int | None = None, rollout: RolloutPlan | None = None,
                    lora_rank: int = 0) -> MemoryBreakdown:
    """Bytes per GPU of training ``dims`` at ``layout``: the pipeline stage with the largest total.

    Args:
        dims: a ``ModelDims`` (``alignment.models.families.model_dims``).
        layout: TP, PP (+ virtual PP), CP, DP (from ``world_size``), sequence parallelism.
        dtype: the weights' dtype, ``float32`` or ``bfloat16`` (``model.dtype``); activations
            use it too.
        micro_batch_size: sequences per forward (``trainer.micro_batch_size``).
        seq_length: tokens per sequence (padded), split over CP.
        distributed_optimizer: ``trainer.use_distributed_optimizer``.
        num_microbatches: micro-batches per step and DP rank; ``None`` = enough to fill the pipeline.
        rollout: a colocated vLLM engine to add (:class:`RolloutPlan`), or ``None``.
        lora_rank: ``model.lora.rank`` (0: full fine-tuning): the base weights frozen, adapters on
            every attention, dense MLP and expert linear (:func:`lora_layer_parameters`) carrying the only
            gradients and Adam state (activations counted as in full fine-tuning: an upper bound).
    Returns:
        the :class:`MemoryBreakdown` of the largest stage.
    Raises:
        ValueError: a non-positive size, an unknown dtype, or a layout whose sizes do not
            divide the model (run :func:`parallel.layout.validate_layout` first for the full check).
    """
    for name, value in (("micro_batch_size", micro_batch_size), ("seq_length", seq_length)):
        if value < 1:
            raise ValueError(f"{name}={value}: must be >= 1")
    dtype_bytes(dtype)
    pp, vpp = layout.pipeline_model_parallel_size, layout.virtual_pipeline_model_parallel_size or 1
    if dims.num_layers % (pp * vpp):
        raise ValueError(f"pipeline_model_parallel_size={pp} x virtual={vpp} must divide the {dims.num_layers} layers")
    if layout.data_parallel_size < 1 or layout.world_size % layout.model_parallel_size:
        raise ValueError(f"world_size={layout.world_size} is not a multiple of TP x PP x CP = "
                         f"{layout.model_parallel_size}")
    stages = [stage_memory(dims, layout, s, dtype=dtype, micro_batch_size=micro_batch_size, seq_length=seq_length,
                           distributed_optimizer=distributed_optimizer, num_microbatches=num_microbatches,
                           rollout=rollout, lora_rank=lora_rank) for s in sorted({0, pp - 1})]
    return max(stages, key=lambda m: m.total)
