"""Model FLOPs per token of a decoder-only model (dense or MoE), and a measured matmul peak, for MFU.

MFU (model FLOPs utilization, PaLM, Chowdhery et al. 2022, appendix B) = the FLOPs the model
needs for the tokens processed / (time x peak FLOP/s). Only matrix products count; norms,
activations and softmax are left out, as in PaLM and Megatron-LM's reports.
"""

from __future__ import annotations

import time

import torch

from alignment.models.dims import ModelDims


def matmul_params(d: ModelDims) -> int:
    """Weights that take part in a matrix product per token: per layer Q, K, V, O and the SwiGLU
    gate, up and down projections (for an MoE layer the router ``[E, H]`` and the ``topk`` experts
    the token is sent to: active parameters, not all experts), plus the output layer
    ``[vocab, hidden]`` (the input embedding is a lookup, not a product). Biases and norms are
    left out."""
    attn = d.hidden_size * d.head_dim * (2 * d.num_attention_heads + 2 * d.num_query_groups)
    dense = 3 * d.hidden_size * d.ffn_hidden_size
    moe = d.num_experts * d.hidden_size + d.moe_router_topk * 3 * d.hidden_size * d.moe_ffn_hidden_size
    return d.num_dense_layers * (attn + dense) + d.num_moe_layers * (attn + moe) + d.vocab_size * d.hidden_size


def flops_per_token(d: ModelDims, seq_length: float, *, training: bool = True, output_fraction: float = 1.0) -> float:
    """Model FLOPs for one token of a sequence of ``seq_length`` tokens.

    Forward: ``2 N`` for the weights (a multiply and an add per weight, ``N`` =
    :func:`matmul_params`) plus causal attention ``2 L H d_head T``: ``Q K^T`` and ``A V`` each
    cost ``2 H d_head`` per key and a token attends to ``T / 2`` keys on average (PaLM's
    ``12 L H Q T`` training term counts all ``T`` keys; ours is its causal half).
    Training (forward + backward): 3 x forward.

    Args:
        seq_length: mean tokens per sequence (> 0).
        output_fraction: the share of tokens whose output-layer product the job needs (in
            ``[0, 1]``): a loss that reads only response positions needs the ``[vocab, hidden]``
            product there only (megalign's ``forward_backward(positions=...)``, TRL's and HF's
            ``logits_to_keep``), so the needed FLOPs count it on those tokens alone.
    Raises:
        ValueError: ``seq_length <= 0`` or ``output_fraction`` outside ``[0, 1]``.
    """
    if seq_length <= 0:
        raise ValueError(f"seq_length={seq_length}: must be > 0")
    if not 0.0 <= output_fraction <= 1.0:
        raise ValueError(f"output_fraction={output_fraction}: must be in [0, 1]")
    output = d.vocab_size * d.hidden_size
    forward = (2 * (matmul_params(d) - output) + 2 * output * output_fraction
               + 2 * d.num_layers * d.num_attention_heads * d.head_dim * seq_length)
    return 3 * forward if training else forward


def measured_matmul_peak(device: str = "cpu", dtype: torch.dtype = torch.float32, n: int = 2048,
                         repeats: int = 5) -> float:
    """FLOP/s of an ``n x n @ n x n`` product on ``device`` with the current torch threads: the
    best of ``repeats`` timed products after one warm-up (``2 n^3`` FLOPs each)."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    a @ b
    sync()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        a @ b
        sync()
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best
