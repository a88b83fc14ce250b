"""Decode steps of fixed shape for Megatron's static engine, captured as CUDA graphs.

Megatron-Core 0.16.1's static engine runs every decode step eagerly, one kernel launch at a time (~63 per layer
and token): on a GPU a step takes as long as its launches, whatever the model's size (0.3-2.3 % of the bandwidth
bound on an H100, docs/results.md). Its own CUDA graphs for that engine need flash-attn's
``flash_attn_with_kvcache``. The obstacle is shape: its decode attends over ``cache[:position + 1]``, a slice
that grows by one every step, so no two steps are the same graph.

:class:`StaticDecoder` runs the decode step with shapes fixed for a span of positions, so that one graph serves
every step of the span (vLLM captures its decode per batch size in the same way):

- the step's position is a tensor (``[1]``), not a Python int: the new key and value are written into Megatron's
  own KV cache (``StaticInferenceContext.key_value_memory_dict``, ``[max_seq, max_batch, kv_heads, head_dim]``
  per layer) with ``index_copy_`` at that position;
- attention reads the cache up to the end of the position's bucket (``bucket`` positions each), masking the
  positions after the current one (:func:`parallel.cached_attention.cached_causal_attention`, as the eager decode); a new
  cache (megatron-core allocates it with ``torch.empty``) is zeroed past the prompt once, since a masked
  position still multiplies its value by 0, and ``inf * 0`` is NaN;
- Megatron keeps keys *before* rotary in its cache and rotates the whole slice at every step; here the cache holds
  rotated keys: the prompt's keys (written by Megatron's eager prefill) are rotated in place once, at the first
  decode step after a prefill, and every new key is rotated before it is stored. Rotation is elementwise, so the
  keys are the same numbers Megatron's step computes.

Everything else is the model's own modules, called as ``TransformerLayer`` calls them: the embedding, each
layer's ``input_layernorm``, ``get_query_key_value_tensors`` (Q/K layernorms included), ``linear_proj``,
``self_attn_bda``, ``pre_mlp_layernorm``, ``mlp``, ``mlp_bda``, the final layernorm and the output layer (a
tensor-parallel model's all-reduces and its logits' gather included). :func:`unsupported` names what the step
does not cover (mixture-of-experts layers, M-RoPE, pipeline or context parallelism, sequence parallelism, ...),
and the engine then decodes eagerly.

On a GPU each ``(batch, bucket)`` is captured once (``torch.cuda.CUDAGraph``, all graphs sharing one memory
pool) and replayed for every later step in it; the graphs are dropped when the KV cache moves (the engine's
``sleep`` frees it) or a parameter's memory does (``trainer.offload``). On a CPU the same step runs without capture
(that is how the CPU tests check it). :meth:`StaticDecoder.decode` is the step alone, as Megatron's loop calls it;
:meth:`StaticDecoder.prepare`, :meth:`StaticDecoder.step` and :meth:`StaticDecoder.run` let a caller put more into
the same graph (:mod:`alignment.rollout.engines.decode_loop` adds the sampling and stop checks).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from parallel.cached_attention import cached_causal_attention

BUCKET = 64  # positions per graph: attention reads the cache up to the bucket's end


@dataclass
class DecodeStep:
    """The fixed-shape inputs of one decode step (:meth:`StaticDecoder.prepare`): each layer's ``(keys,
    values)`` cache ``[max_seq, max_batch, kv_heads, head_dim]``, the tokens ``[batch, 1]`` and position
    ``[1]`` (the same tensors for every step of a batch size), and ``end``, where attention stops reading the
    cache (the end of the position's bucket)."""

    caches: list
    tokens: torch.Tensor
    position: torch.Tensor
    end: int
    batch: int


def unsupported(model) -> str | None:
    """Why :class:`StaticDecoder` cannot run ``model`` (a Megatron ``GPTModel``), or None when it can.

    The step covers a dense decoder with rotary positions on one pipeline stage and one context-parallel rank,
    with Megatron's plain layer (pre-norm, self-attention, MLP), tensor parallel or not."""
    c = model.config
    layers = getattr(getattr(model, "decoder", None), "layers", None)
    checks = [
        (layers is None or type(model).__name__ != "GPTModel", "not a plain GPTModel (a vision-language model?)"),
        (not (getattr(model, "pre_process", True) and getattr(model, "post_process", True)), "pipeline parallel"),
        (getattr(c, "context_parallel_size", 1) > 1, "context parallel"),
        (getattr(c, "sequence_parallel", False), "sequence parallel"),
        (getattr(c, "num_moe_experts", None), "mixture-of-experts layers"),
        (getattr(model, "position_embedding_type", "rope") != "rope", "positions other than plain rotary"),
        (getattr(c, "multi_latent_attention", False), "multi-latent attention"),
        (getattr(c, "attention_output_gate", False), "gated attention"),
        (getattr(c, "window_size", None) is not None, "sliding-window attention"),
        (getattr(c, "no_rope_freq", None), "layers without rotary"),
        (getattr(c, "flash_decode", False), "flash decoding"),
        (getattr(c, "apply_residual_connection_post_layernorm", False), "post-layernorm residuals"),
        (getattr(c, "mtp_num_layers", None), "multi-token prediction"),
        (getattr(c, "inference_fuse_tp_communication", False), "fused TP inference kernels"),
        (getattr(c, "softmax_type", "vanilla") != "vanilla", "a non-vanilla softmax"),
        (getattr(c, "fp8", None) or getattr(c, "fp4", None), "fp8/fp4"),
        (getattr(c, "apply_query_key_layer_scaling", False), "query-key layer scaling"),
    ]
    for bad, why in checks:
        if bad:
            return why
    for layer in layers:
        if not hasattr(layer.self_attention, "get_query_key_value_tensors") or hasattr(layer.mlp, "router") \
                or type(layer.cross_attention).__name__ != "IdentityOp":
            return f"layer {layer.layer_number} is not self-attention + dense MLP"
    return None


class StaticDecoder:
    """Decode steps of ``model`` (a Megatron ``GPTModel``, see :func:`unsupported`) against the KV cache of a
    ``StaticInferenceContext``, as CUDA graphs when ``graphs`` (GPU only).

    Use: :meth:`prefilled` after every eager forward of more than one token (the prefill wrote un-rotated prompt
    keys), then :meth:`decode` for each one-token step.

    Args:
        model: the model (eval mode while decoding); its parameters are read in place, so the graphs see every
            update of the trainer's weights.
        graphs: capture each ``(batch, bucket)`` as a CUDA graph on first use and replay it after.
        bucket: positions per graph (attention reads the cache up to the bucket's end).

    Raises:
        ValueError: the model is one :func:`unsupported` names.
    """

    def __init__(self, model, *, graphs: bool, bucket: int = BUCKET):
        why = unsupported(model)
        if why is not None:
            raise ValueError(f"static decode: {why}")
        self.model, self.graphs, self.bucket = model, graphs, bucket
        self.layers = list(model.decoder.layers)
        self._rope = None  # [max_seq, 1, 1, rot_dim], per max_seq
        self._rotated = True
        self._captured: dict[tuple, tuple[object, object]] = {}  # key -> (graph, its outputs)
        self._inputs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # batch -> (tokens [b, 1], position [1])
        self._cache_ptr = None
        self._pool = None
        self._weights: tuple[int, ...] = ()  # the parameters' addresses the graphs were captured with
        self.captures = 0  # graphs captured so far (the bench reports it)

    def prefilled(self) -> None:
        """An eager forward just wrote prompt keys un-rotated: rotate them at the next :meth:`decode`. Also drops
        the graphs if any parameter's memory moved since they were captured (``trainer.offload`` frees and
        re-allocates it; a graph reads the addresses it was captured with)."""
        self._rotated = False
        weights = tuple(p.data_ptr() for p in self.model.parameters())
        if weights != self._weights:
            self.reset()
            self._weights = weights

    def reset(self) -> None:
        """Drop the graphs and their memory pool (the KV cache they point into is gone or moved)."""
        self._captured.clear()
        self._inputs.clear()
        self._pool, self._cache_ptr = None, None

    def decode(self, tokens: torch.Tensor, context) -> torch.Tensor:
        """One decode step: ``tokens`` ``[batch, 1]`` at position ``context.sequence_len_offset`` (every row at
        the same position, as Megatron's static batching has them). Writes the step's keys and values into the
        context's cache and returns the logits ``[batch, 1, padded_vocab]`` (the model's dtype), as the model's
        forward returns them. The context's offset is left for the caller to advance."""
        step = self.prepare(tokens, context)
        return self.run((step.batch, step.end), lambda: self.step(step))

    def prepare(self, tokens: torch.Tensor, context) -> "DecodeStep":
        """Set up the step of ``tokens`` ``[batch, 1]`` at position ``context.sequence_len_offset`` and return its
        fixed-shape inputs (:class:`DecodeStep`; the same tensors for every step of a batch size): a new KV cache
        is zeroed past the prompt and drops the graphs of the old one, the prompt's keys are rotated after a
        prefill, and the tokens and position are copied into the batch size's input tensors."""
        batch, position = tokens.size(0), int(context.sequence_len_offset)
        caches = [context.key_value_memory_dict[layer.layer_number] for layer in self.layers]
        max_seq = caches[0][0].size(0)
        if self._rope is None or self._rope.size(0) != max_seq:
            self._rope = self.model.rotary_pos_emb(max_seq)
        if caches[0][0].data_ptr() != self._cache_ptr:  # a new cache (after sleep): old graphs point at the old
            self.reset()
            self._cache_ptr = caches[0][0].data_ptr()
            for keys, values in caches:  # megatron-core allocates it empty: masked garbage (inf * 0) would be NaN
                keys[position:].zero_()
                values[position:].zero_()
        if not self._rotated:
            self._rotate_prompt_keys(caches, batch, position)
        if batch not in self._inputs:
            self._inputs[batch] = (torch.zeros(batch, 1, dtype=torch.long, device=tokens.device),
                                   torch.zeros(1, dtype=torch.long, device=tokens.device))
        tokens_in, position_in = self._inputs[batch]
        tokens_in.copy_(tokens)
        position_in.fill_(position)
        end = min(max_seq, (position // self.bucket + 1) * self.bucket)
        return DecodeStep(caches, tokens_in, position_in, end, batch)

    def step(self, step: "DecodeStep") -> torch.Tensor:
        """The decode step on :meth:`prepare`'s fixed-shape inputs: logits ``[batch, 1, padded_vocab]``."""
        return self._step(step.caches, step.tokens, step.position, step.end)

    def run(self, key: tuple, fn, restore: tuple[torch.Tensor, ...] = ()):
        """``fn()``: tensor work on fixed inputs (a step from :meth:`step`, and what a caller adds to it); with
        ``graphs``, captured into a CUDA graph the first time ``key`` comes and replayed after (the returned
        tensors are the graph's, overwritten by its next replay). The capture runs ``fn`` once eagerly first (on
        a side stream), which does the step's work; ``restore``: tensors that ``fn`` updates in place and that
        must not see that work twice (done flags), put back to their values before it, as is the RNG state."""
        if not self.graphs:
            return fn()
        if key not in self._captured:
            self._captured[key] = self._capture(fn, restore)
        graph, out = self._captured[key]
        graph.replay()
        return out

    def _capture(self, fn, restore):
        """Warm ``fn`` up once on a side stream, put ``restore`` and the CUDA RNG state back (a sampler's draws are
        then those the eager loop makes: the first replay draws what the warm-up drew), then capture ``fn`` into
        the shared pool."""
        saved, rng = [t.clone() for t in restore], torch.cuda.get_rng_state()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn()
        torch.cuda.current_stream().wait_stream(stream)
        for t, before in zip(restore, saved):
            t.copy_(before)
        torch.cuda.set_rng_state(rng)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            out = fn()
        self._pool = graph.pool()
        self.captures += 1
        return graph, out

    def _rotate_prompt_keys(self, caches, batch: int, position: int) -> None:
        """Rotate the keys of positions ``[0, position)`` in place (Megatron's prefill stored them un-rotated)."""
        from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb

        freqs = self._rope[:position]
        for layer, (keys, _) in zip(self.layers, caches):
            prompt = keys[:position, :batch]
            prompt.copy_(apply_rotary_pos_emb(prompt, freqs, config=layer.config))
        self._rotated = True

    def _step(self, caches, tokens, position, end: int) -> torch.Tensor:
        """The decode step on fixed shapes: ``tokens`` ``[b, 1]``, ``position`` ``[1]``; attention over cache
        positions ``[0, end)``, those after ``position`` masked. Returns logits ``[b, 1, padded_vocab]``."""
        from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb

        model, batch = self.model, tokens.size(0)
        hidden = model.embedding(input_ids=tokens, position_ids=position.expand(batch, 1))  # [1, b, h]
        freqs = self._rope.index_select(0, position)  # [1, 1, 1, rot_dim]
        visible = (torch.arange(end, device=tokens.device) <= position).view(1, end)  # [1 query, end keys]
        for layer, (keys, values) in zip(self.layers, caches):
            attention, config = layer.self_attention, layer.config
            residual = hidden
            query, key, value = attention.get_query_key_value_tensors(layer.input_layernorm(hidden))  # [1, b, n, d]
            query = apply_rotary_pos_emb(query, freqs, config=config)
            key = apply_rotary_pos_emb(key, freqs, config=config)
            keys[:, :batch].index_copy_(0, position, key)
            values[:, :batch].index_copy_(0, position, value)
            context = cached_causal_attention(
                query.permute(1, 2, 0, 3), keys[:end, :batch].permute(1, 2, 0, 3),
                values[:end, :batch].permute(1, 2, 0, 3), attention.core_attention.softmax_scale,
                mask=visible)  # [b, heads, 1, d]
            context = context.permute(2, 0, 1, 3).reshape(1, batch, -1)
            hidden = layer.self_attn_bda(False, config.bias_dropout_fusion)(
                attention.linear_proj(context), residual, layer.hidden_dropout)
            residual = hidden
            hidden = layer.mlp_bda(False, config.bias_dropout_fusion)(
                layer.mlp(layer.pre_mlp_layernorm(hidden)), residual, layer.hidden_dropout)
        hidden = model.decoder.final_layernorm(hidden)
        weight = model.shared_embedding_or_output_weight() if model.share_embeddings_and_output_weights else None
        logits, _ = model.output_layer(hidden, weight=weight, runtime_gather_output=True)
        return logits.transpose(0, 1)  # [b, 1, vocab]
