"""Reward models and critics: a Megatron-Core ``GPTModel`` whose LM head is replaced by a
scalar head (as NeMo-Aligner's reward model; HF equivalent: ``LlamaForSequenceClassification``
with ``num_labels=1``, whose ``score.weight`` is this head's weight).

The head is a ``[1, hidden]`` weight replicated on every tensor-parallel rank and held by
the last pipeline stage only. Its output for a batch is ``[batch, seq, 1]``: position ``t``
scores the prefix ``input_ids[:, : t + 1]``. A critic reads it at every response
position (values); a reward model reads it at the last real token of each sequence
(:func:`sequence_scores`), which is exactly what HF's sequence classifier pools.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from alignment.models.gpt import build_gpt_model, place_shard


class ScalarHead(torch.nn.Module):
    """Drop-in for ``GPTModel.output_layer``: ``[s, b, hidden] -> ([s, b, 1], None)``.

    Under sequence parallelism the hidden states arrive split along the sequence; they are
    all-gathered first. Every TP rank then computes the same full output, so the gather's
    backward only splits the gradient (``tensor_parallel_output_grad=False``).
    Initialised from ``N(0, 1 / (hidden + 1))`` with a fixed seed, identically on every rank
    (TRL's reward-model head initialisation).
    """

    def __init__(self, config, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        w = torch.randn(1, config.hidden_size, generator=g) / math.sqrt(config.hidden_size + 1)
        self.weight = torch.nn.Parameter(w.to(config.params_dtype))
        self.sequence_parallel = config.sequence_parallel

    def forward(self, hidden_states, weight=None, runtime_gather_output=None):
        from megatron.core import parallel_state as ps
        from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

        if self.sequence_parallel and ps.get_tensor_model_parallel_world_size() > 1:
            hidden_states = gather_from_sequence_parallel_region(hidden_states, tensor_parallel_output_grad=False)
        return F.linear(hidden_states, self.weight), None


def build_value_model(hf_config, config, *, vp_stage: int | None = None, seed: int = 0):
    """A ``GPTModel`` shard with a :class:`ScalarHead` on the last pipeline stage.

    Built untied (``share_embeddings_and_output_weights=False``): the embedding stays the
    model's, the head is new. Returns a model whose forward gives ``[batch, seq, 1]`` on the
    last stage. Load weights with ``load_hf_weights(model, hf, get_bridge(cfg, head="score"))``
    (pass ``skip=("output_layer.weight",)`` when starting from a causal-LM checkpoint).
    """

    model = build_gpt_model(hf_config, config, vp_stage=vp_stage, share_embeddings=False)
    if model.post_process:
        model.output_layer = ScalarHead(config, seed=seed)
    return place_shard(model)


def sequence_scores(values: torch.Tensor, last_index: torch.Tensor) -> torch.Tensor:
    """The score of each sequence: ``values[i, last_index[i]]``.

    Args:
        values: ``[batch, seq]`` or ``[batch, seq, 1]`` head outputs.
        last_index: ``[batch]`` position of each row's last real (non-padding) token.
    Returns:
        ``[batch]`` (differentiable).
    Raises:
        ValueError: an index outside ``[0, seq)`` or mismatched batch sizes.
    """
    if values.dim() == 3:
        values = values.squeeze(-1)
    if last_index.shape != values.shape[:1]:
        raise ValueError(f"last_index shape {tuple(last_index.shape)} != batch {values.shape[0]}")
    if bool((last_index < 0).any()) or bool((last_index >= values.shape[1]).any()):
        raise ValueError(f"last_index must be in [0, {values.shape[1]}), got {last_index.tolist()}")
    return values.gather(1, last_index.long().unsqueeze(1)).squeeze(1)
