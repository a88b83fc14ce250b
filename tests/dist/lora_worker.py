"""torchrun worker (2 processes): LoRA on Megatron's tensor-parallel linears against the dense math.

    torchrun --nproc-per-node 2 tests/dist/lora_worker.py RESULT.json

For each layout (TP 1 with DP 2, TP 2, TP 2 with sequence parallelism):

- ``linears``: a column-parallel and a row-parallel linear whose ``W``, ``A``, ``B`` and input
  are slices of seeded full tensors; the output, the input gradient and the full gradients of
  ``A`` and ``B`` (this rank's slices gathered; replicated ones all-reduced over TP when they are
  marked ``sequence_parallel``, as Megatron's ``finalize_model_grads`` does) are compared with
  single-process autograd of ``x (W + scale B A)^T``; the base weight gets no gradient.
- ``zero_b``: with ``B = 0`` (the initialisation) the adapted linears' outputs equal the base's
  exactly.
- ``model``: a tiny Llama (GQA, gated MLP) with adapters on every attention and MLP linear and
  random ``B``: its logits equal those of a copy whose weights are ``merged_narrow`` of the whole
  shard (``W + scale B A``); ``adapters_disabled`` gives the base model's logits exactly; the
  resharder (colocated, vLLM TP 1) yields vLLM's sharding of the merged HF export and aliases no
  adapted weight. Also: dropout only in passes that build a graph; targets that adapt nothing
  are refused.

Writes {layout: [rank 0's {check: max abs error or bool}, rank 1's]}: every rank's checks.
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist

from parallel.layout import ParallelLayout
from parallel.lora import LoRASpec, adapters, adapters_disabled, apply_lora, merged_narrow
from parallel.state import init_distributed
from tests.dist.report import every_rank, exit_now

LAYOUTS = {"tp1": (1, False), "tp2": (2, False), "tp2_sp": (2, True)}
S, B_, IN, OUT, R = 6, 2, 16, 12, 4  # sequence, batch, features, rank
SPEC = LoRASpec(rank=R, alpha=8.0, seed=3)


def full(seed: int, *shape) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).float()


def linears_case(tp: int, sp: bool) -> dict:
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer import TransformerConfig

    cfg = TransformerConfig(num_layers=1, hidden_size=IN, num_attention_heads=2, tensor_model_parallel_size=tp,
                            sequence_parallel=sp, perform_initialization=False, use_cpu_initialization=True)
    rank, group = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_group()
    out = {}
    for kind in ("column", "row"):
        w, x, g = full(1, OUT, IN), full(2, S, B_, IN), full(3, S, B_, OUT)
        a, b = full(4, R, IN) * 0.3, full(5, OUT, R) * 0.3
        holder = torch.nn.Module()
        if kind == "column":
            lin = ColumnParallelLinear(IN, OUT, config=cfg, init_method=lambda t: None, bias=False)
            w_local = w.chunk(tp, 0)[rank]
            x_local = x.chunk(tp, 0)[rank] if sp else x
            g_local = g.chunk(tp, 2)[rank]
        else:
            lin = RowParallelLinear(IN, OUT, config=cfg, init_method=lambda t: None, bias=False,
                                    input_is_parallel=True, skip_bias_add=False)
            w_local = w.chunk(tp, 1)[rank]
            x_local = x.chunk(tp, 2)[rank]
            g_local = g.chunk(tp, 0)[rank] if sp else g
        holder.linear_qkv = lin  # a target name; the kind comes from the class
        with torch.no_grad():
            lin.weight.copy_(w_local)
        base_out = lin(x_local)[0].detach().clone()
        apply_lora(holder, SPEC)
        (adapter,) = adapters(holder)
        out[f"{kind}_zero_b_equal"] = bool(torch.equal(lin(x_local)[0], base_out))
        with torch.no_grad():
            adapter.A.copy_(a if kind == "column" else a.chunk(tp, 1)[rank])
            adapter.B.copy_(b.chunk(tp, 0)[rank] if kind == "column" else b)
        xl = x_local.clone().requires_grad_(True)
        y = lin(xl)[0]
        (y * g_local).sum().backward()
        for p in (adapter.A, adapter.B):
            if getattr(p, "sequence_parallel", False):
                dist.all_reduce(p.grad, group=group)

        def gather(t, dim):
            parts = [torch.empty_like(t) for _ in range(tp)]
            dist.all_gather(parts, t.contiguous(), group=group)
            return torch.cat(parts, dim)

        if kind == "column":
            y_full = gather(y.detach(), 2)
            dx = gather(xl.grad, 0) if sp else xl.grad
            da, db = adapter.A.grad, gather(adapter.B.grad, 0)
        else:
            y_full = gather(y.detach(), 0) if sp else y.detach()
            dx = gather(xl.grad, 2)
            da, db = gather(adapter.A.grad, 1), adapter.B.grad
        xr, ar, br = (t.clone().double().requires_grad_(True) for t in (x, a, b))
        yr = xr @ (w.double() + SPEC.scale * br @ ar).t()
        (yr * g.double()).sum().backward()
        out[f"{kind}_out"] = (y_full.double() - yr).abs().max().item()
        out[f"{kind}_dx"] = (dx.double() - xr.grad).abs().max().item()
        out[f"{kind}_dA"] = (da.double() - ar.grad).abs().max().item()
        out[f"{kind}_dB"] = (db.double() - br.grad).abs().max().item()
        out[f"{kind}_base_grad_none"] = lin.weight.grad is None and not lin.weight.requires_grad
        # dropout on the adapter's input: in passes that build a graph only
        adapter.dropout = torch.nn.Dropout(0.5)
        lin.train()
        with torch.no_grad():
            out[f"{kind}_dropout_off_without_grad"] = bool(torch.equal(lin(x_local)[0], lin(x_local)[0]))
        out[f"{kind}_dropout_on_with_grad"] = not torch.equal(lin(xl)[0], lin(xl)[0])
        adapter.dropout = None
    holder = torch.nn.Module()
    holder.other = ColumnParallelLinear(IN, OUT, config=cfg, init_method=lambda t: None, bias=False)
    try:
        apply_lora(holder, SPEC)
        out["nothing_adapted_refused"] = False
    except ValueError as e:
        out["nothing_adapted_refused"] = "adapts no linear" in str(e)
    return out


def model_case(tp: int, sp: bool) -> dict:
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

    from alignment.models.families import get_bridge
    from alignment.models.gpt import build_gpt_model, transformer_config
    from alignment.models.weights import export_hf_weights, load_hf_weights
    from alignment.rollout.engines.weight_check import vllm_reference_shard
    from parallel.reshard import Resharder
    from tests.dist.reshard_worker import hf_model
    from tests.dist.tiny_models import checkpoint_state

    hf = hf_model("gqa")
    state, bridge = checkpoint_state(hf), get_bridge(hf.config)
    tcfg = lambda: transformer_config(hf.config, tensor_model_parallel_size=tp, sequence_parallel=sp)  # noqa: E731
    lora_model, merged = build_gpt_model(hf.config, tcfg()).eval(), build_gpt_model(hf.config, tcfg()).eval()
    load_hf_weights(lora_model, state, bridge)
    load_hf_weights(merged, state, bridge)
    names = apply_lora(lora_model, SPEC)
    rank = ps.get_tensor_model_parallel_rank()
    with torch.no_grad():
        for j, ad in enumerate(adapters(lora_model)):
            split = ad.kind == "column"  # B split by rows; a row-parallel adapter's B is the same on every rank
            ad.B.copy_(full(100 + 10 * j + (rank if split else 0), *ad.B.shape) * 0.1)
        merged_params = dict(merged.named_parameters())
        for name, p in lora_model.named_parameters():
            if hasattr(p, "lora_adapter"):
                merged_params[name].copy_(merged_narrow(p, 0, 0, p.shape[0]))
    ids = torch.randint(0, hf.config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(7))
    pos = torch.arange(8).expand_as(ids)

    def logits(m):
        with torch.no_grad():
            return gather_from_tensor_model_parallel_region(m(ids, pos, None))

    # the weight sync (colocated, an engine per rank, small buckets) yields vLLM's sharding of the merged model,
    # and never passes an adapted weight on as the live parameter
    merged_state = export_hf_weights(lora_model, bridge)
    resharder = Resharder(lora_model, bridge.vllm_layout(tp, 1), vllm_tp=1, bucket_bytes=16 << 10)
    sync_wrong, sync_tensors = [], 0
    for bucket in resharder.buckets():
        for name, t in bucket:
            sync_tensors += 1
            if not torch.allclose(t, vllm_reference_shard(bridge, merged_state, name, 1, 0), rtol=0, atol=1e-6):
                sync_wrong.append(name)
    adapted = {n for n, p in lora_model.named_parameters() if hasattr(p, "lora_adapter")}
    aliased = sorted({src for b in resharder.plan.buckets for src in b.alias.values()})
    base = build_gpt_model(hf.config, tcfg()).eval()
    load_hf_weights(base, state, bridge)
    with adapters_disabled(lora_model):
        disabled_equal = bool(torch.equal(logits(lora_model), logits(base)))
    return {"adapted": len(names), "sync_wrong": sync_wrong[:3], "sync_tensors": sync_tensors,
            "aliased": aliased, "aliased_adapted": sorted(set(aliased) & adapted),
            "model_vs_merged": (logits(lora_model) - logits(merged)).abs().max().item(),
            "adapters_change_logits": (logits(lora_model) - logits(base)).abs().max().item(),
            "disabled_equals_base": disabled_equal,
            "trainable": sorted({n.rsplit(".", 1)[-1] for n, p in lora_model.named_parameters() if p.requires_grad})}


def main(path: str) -> None:
    results = {}
    for name, (tp, sp) in LAYOUTS.items():
        init_distributed(ParallelLayout(world_size=2, tensor_model_parallel_size=tp, sequence_parallel=sp))
        results[name] = every_rank({**linears_case(tp, sp), **model_case(tp, sp)})  # each rank's own checks
    if dist.get_rank() == 0:
        with open(path, "w") as f:
            json.dump(results, f, indent=1)
    dist.barrier()


if __name__ == "__main__":
    main(sys.argv[1])
    exit_now()
