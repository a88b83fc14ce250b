"""torchrun worker (2 processes): gradients of LoRA adapters through Megatron equal single-process
autograd on a PEFT-wrapped HF model (``peft.get_peft_model``), for the GRPO loss and the DPO loss.

Both sides start from the same adapters (rank 4, alpha 8, random A and B; ``q_proj`` / ``k_proj`` /
``v_proj`` share one A, as do ``gate_proj`` / ``up_proj``, since Megatron fuses them into one linear
with one adapter), loaded into Megatron with :func:`alignment.models.lora_export.load_lora_adapters`.
Megatron's gradients come back PEFT-named through :func:`export_lora_adapters`; a fused linear's
``A`` gradient is the sum of its projections' ``A`` gradients in PEFT.
Layouts: DP 2, TP 2, TP 2 with sequence parallelism, PP 2 (GRPO: micro-batches of 2 rows; DPO: 1
pair). Writes {loss: {case: {"loss", "max_grad_diff"}, "reference_loss", "reference_max_grad",
"tensors"}}.

``grpo_moe``: a tiny Qwen3-MoE (4 experts, top 2, every layer sparse) with adapters on its attention
and on every expert's ``linear_fc1`` / ``linear_fc2``, at EP 1 (DP 2), EP 2, TP 2 (expert TP 2,
sequence parallel) and TP 2 x EP 2 with expert TP 1, against PEFT's adapters on transformers 5's
stacked expert parameters (``target_parameters``, rank r: the same math as Megatron's one adapter
per expert linear); the EP 2 case also writes the PEFT directory, which ``PeftModel.from_pretrained``
must load onto the HF base with the reference's logits (``peft_logits_diff``), and at EP 2 the
weight sync into vLLM's fused-MoE layout must equal vLLM's loaders on PEFT's merged model.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import torch

from parallel.lora import LoRASpec
from parallel.state import env_world
from tests.dist import grpo_invariance_worker as grpo
from tests.dist import offline_invariance_worker as offline
from tests.dist.report import every_rank, worst_over_ranks, write_results_and_shutdown, exit_now

SPEC = LoRASpec(rank=4, alpha=8.0)
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
FUSED = {"k_proj": "q_proj", "v_proj": "q_proj", "up_proj": "gate_proj"}  # projection -> the one holding its A
LAYOUTS = {"dp2": dict(), "tp2": dict(tensor_model_parallel_size=2),
           "tp2_sp": dict(tensor_model_parallel_size=2, sequence_parallel=True),
           "pp2": dict(pipeline_model_parallel_size=2)}


def adapter_values(hf, targets=TARGETS) -> dict[str, torch.Tensor]:
    """PEFT-named adapters for every linear of ``hf`` named by ``targets`` (default: a causal LM's
    projections), fused projections sharing A."""
    g = torch.Generator().manual_seed(21)
    out = {}
    for name, module in hf.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if leaf not in targets or not isinstance(module, torch.nn.Linear):
            continue
        prefix = f"base_model.model.{name}"
        a = out.get(f"{prefix.rsplit('.', 1)[0]}.{FUSED[leaf]}.lora_A.weight") if leaf in FUSED else None
        out[f"{prefix}.lora_A.weight"] = a if a is not None else 0.3 * torch.randn(SPEC.rank, module.in_features,
                                                                                    generator=g)
        out[f"{prefix}.lora_B.weight"] = 0.1 * torch.randn(module.out_features, SPEC.rank, generator=g)
    return out


def peft_wrapped(hf, values, targets=TARGETS):
    """``hf`` with PEFT's adapters on ``targets`` (leaf names, or PEFT's regex over module names) set to ``values``."""
    from peft import LoraConfig, get_peft_model, set_peft_model_state_dict

    model = get_peft_model(hf, LoraConfig(r=SPEC.rank, lora_alpha=SPEC.alpha, lora_dropout=0.0,
                                          target_modules=targets if isinstance(targets, str) else list(targets)))
    result = set_peft_model_state_dict(model, values)
    assert not [k for k in result.missing_keys if "lora_" in k], result.missing_keys
    return model


def expected(peft_grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """PEFT's gradients in export form: ``.default`` dropped, a fused linear's A gradient summed
    over its projections (Megatron's one A receives all of them)."""
    grads = {k.replace(".default.", "."): v for k, v in peft_grads.items()}
    out = dict(grads)
    for key in grads:
        module, leaf = key.split(".lora_")[0].rsplit(".", 1)
        if key.endswith("lora_A.weight") and leaf in ("q_proj", "gate_proj"):
            group = [p for p, holder in FUSED.items() if holder == leaf] + [leaf]
            total = sum(grads[f"{module}.{p}.lora_A.weight"] for p in group)
            for p in group:
                out[f"{module}.{p}.lora_A.weight"] = total
    return out


def compare(grads: dict, want: dict) -> dict:
    """The largest absolute difference, and the largest relative to its tensor's largest gradient,
    over every rank's gradients (collective: each rank compares what it exported)."""
    assert set(grads) == set(want), sorted(set(grads) ^ set(want))
    diff = {k: (grads[k] - want[k]).abs().max().item() for k in grads}
    rel = {k: diff[k] / max(want[k].abs().max().item(), 1e-12) for k in grads}
    worst = max(rel, key=rel.get)
    max_rel, worst = max(every_rank([rel[worst], worst]))
    return {"max_grad_diff": worst_over_ranks(max(diff.values())), "max_rel_diff": max_rel, "worst": worst}


MOE_LAYOUTS = {"ep1": dict(), "ep2": dict(expert_model_parallel_size=2),
               "tp2_etp2_sp": dict(tensor_model_parallel_size=2, sequence_parallel=True),
               "tp2_ep2_etp1": dict(tensor_model_parallel_size=2, sequence_parallel=True,
                                    expert_model_parallel_size=2, expert_tensor_parallel_size=1)}


def moe_peft(hf, values: dict[str, torch.Tensor]):
    """A copy of ``hf`` (Qwen3-MoE) with PEFT adapters on the attention projections and on the
    stacked experts (``target_parameters``), set from per-expert PEFT names (``values``)."""
    from peft import LoraConfig, get_peft_model
    from peft.tuners.lora.layer import LoraLayer, ParamWrapper

    model = get_peft_model(copy.deepcopy(hf), LoraConfig(r=SPEC.rank, lora_alpha=SPEC.alpha, target_modules=TARGETS[:4],
                                                         target_parameters=["gate_up_proj", "down_proj"]))
    with torch.no_grad():
        for name, m in model.named_modules():
            if isinstance(m, ParamWrapper):
                a, b = m.lora_A["default"].weight, m.lora_B["default"].weight
                per_expert = [expert_adapter(values, name, m.parameter_name, e) for e in range(m.num_experts)]
                a.copy_(torch.stack([pa for pa, _ in per_expert]).flatten(0, 1))  # [E r, in]
                b.copy_(torch.stack([pb for _, pb in per_expert], -1).flatten(1))  # [out, r E], expert fastest
            elif isinstance(m, LoraLayer):
                m.lora_A["default"].weight.copy_(values[f"{name}.lora_A.weight"])
                m.lora_B["default"].weight.copy_(values[f"{name}.lora_B.weight"])
    return model


def expert_adapter(values, module: str, param: str, e: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(A [r, in], B [out, r])`` of expert ``e``'s ``param`` (``gate_up_proj``: rows [gate; up])."""
    prefix = f"{module.replace('.base_layer', '')}.{e}."
    if param == "down_proj":
        return values[prefix + "down_proj.lora_A.weight"], values[prefix + "down_proj.lora_B.weight"]
    return values[prefix + "gate_proj.lora_A.weight"], torch.cat([values[prefix + "gate_proj.lora_B.weight"],
                                                                  values[prefix + "up_proj.lora_B.weight"]])


def moe_peft_grads(model) -> dict[str, torch.Tensor]:
    """``model``'s adapter gradients in per-expert PEFT names (export form: a fused linear's A
    gradient under each of its projections)."""
    from peft.tuners.lora.layer import LoraLayer, ParamWrapper

    out = {}
    for name, m in model.named_modules():
        if isinstance(m, ParamWrapper):
            ga, gb = m.lora_A["default"].weight.grad, m.lora_B["default"].weight.grad
            ga, gb = ga.view(m.num_experts, SPEC.rank, -1), gb.view(gb.shape[0], SPEC.rank, m.num_experts)
            prefix = name.replace(".base_layer", "")
            for e in range(m.num_experts):
                rows = {"down_proj": gb[..., e]} if m.parameter_name == "down_proj" else dict(
                    zip(("gate_proj", "up_proj"), gb[..., e].chunk(2)))
                for proj, b in rows.items():
                    out[f"{prefix}.{e}.{proj}.lora_A.weight"] = ga[e]
                    out[f"{prefix}.{e}.{proj}.lora_B.weight"] = b
        elif isinstance(m, LoraLayer):
            out[f"{name}.lora_A.weight"] = m.lora_A["default"].weight.grad
            out[f"{name}.lora_B.weight"] = m.lora_B["default"].weight.grad
    return out


def moe_values(hf) -> dict[str, torch.Tensor]:
    """Per-expert PEFT-named adapters of a Qwen3-MoE (attention as :func:`adapter_values`)."""
    g = torch.Generator().manual_seed(22)
    out = {k: v for k, v in adapter_values(hf).items() if ".mlp." not in k}
    c = hf.config
    for i in range(c.num_hidden_layers):
        for e in range(c.num_experts):
            p = f"base_model.model.model.layers.{i}.mlp.experts.{e}."
            a = 0.3 * torch.randn(SPEC.rank, c.hidden_size, generator=g)
            for proj in ("gate_proj", "up_proj"):
                out[p + proj + ".lora_A.weight"] = a
                out[p + proj + ".lora_B.weight"] = 0.1 * torch.randn(c.moe_intermediate_size, SPEC.rank, generator=g)
            out[p + "down_proj.lora_A.weight"] = 0.3 * torch.randn(SPEC.rank, c.moe_intermediate_size, generator=g)
            out[p + "down_proj.lora_B.weight"] = 0.1 * torch.randn(c.hidden_size, SPEC.rank, generator=g)
    return out


def moe_case(world: int, peft_dir: str) -> dict:
    import torch.distributed as dist

    from tests.dist.tiny_models import checkpoint_state, tiny_qwen3_moe

    hf = tiny_qwen3_moe(seed=3, mlp_only_layers=())
    state, values = checkpoint_state(hf), moe_values(hf)
    batch = grpo.make_batch(hf.config.vocab_size)
    reference = moe_peft(hf, values)
    ref_loss, _ = grpo.hf_reference(reference, batch)
    grads = moe_peft_grads(reference)  # the experts' fused A gradients are already whole
    want = {**expected({k: g for k, g in grads.items() if ".experts." not in k}),
            **{k: g for k, g in grads.items() if ".experts." in k}}
    res = {"reference_loss": ref_loss, "reference_max_grad": max(g.abs().max().item() for g in want.values()),
           "tensors": len(want)}
    for name, sizes in MOE_LAYOUTS.items():
        loss, grads = grpo.megatron_case(hf, batch, world, 2, state=state, lora=SPEC, adapters=values,
                                         peft_dir=peft_dir if name == "ep2" else None, **sizes)
        res[name] = {"loss": loss, **compare(grads, want)}
    res.update(moe_sync_case(hf, state, values, reference, world, peft_dir + "_ckpt"))
    if dist.get_rank() == 0:  # the PEFT directory written at EP 2, loaded by PEFT onto the HF base
        from peft import PeftModel

        with torch.no_grad():
            got = PeftModel.from_pretrained(copy.deepcopy(hf), peft_dir)(batch["input_ids"]).logits
            res["peft_logits_diff"] = (got - reference(batch["input_ids"]).logits).abs().max().item()
            res["adapter_effect"] = (hf(batch["input_ids"]).logits - got).abs().max().item()
    return res


def moe_sync_case(hf, state, values, reference, world: int, ckpt_dir: str) -> dict:
    """EP 2: the weight sync into vLLM TP 1 and TP 2 (fused-MoE layout) yields, tensor by tensor,
    what vLLM's loaders make of PEFT's merged model (``merge_and_unload``), and aliases no adapted
    weight; the adapters saved there (adapters-only checkpoint in ``ckpt_dir``) load back exactly
    at EP 1 with expert TP 2."""
    import torch.distributed as dist

    from alignment.models.families import get_bridge
    from alignment.models.gpt import build_gpt_model, transformer_config
    from alignment.models.lora_export import load_lora_adapters
    from alignment.models.weights import load_hf_weights
    from alignment.rollout.engines.weight_check import vllm_reference_shard
    from parallel.layout import ParallelLayout
    from parallel.lora import apply_lora
    from parallel.reshard import Resharder
    from parallel.state import init_distributed
    from tests.dist.tiny_models import checkpoint_state

    init_distributed(ParallelLayout(world_size=world, expert_model_parallel_size=2))
    model, bridge = build_gpt_model(hf.config, transformer_config(hf.config, expert_model_parallel_size=2)), \
        get_bridge(hf.config)
    load_hf_weights(model, state, bridge)
    apply_lora(model, SPEC)
    load_lora_adapters(model, bridge, values)
    merged = checkpoint_state(copy.deepcopy(reference).merge_and_unload())
    wrong, count, worst = [], 0, 0.0
    for vtp in (1, 2):
        resharder = Resharder(model, bridge.vllm_layout(1, vtp, None), vllm_tp=vtp, bucket_bytes=16 << 10)
        for bucket in resharder.buckets():
            for name, t in bucket:
                want = vllm_reference_shard(bridge, merged, name, vtp, dist.get_rank() % vtp)
                count += 1
                worst = max(worst, (t - want).abs().max().item())
                if not torch.allclose(t, want, rtol=0, atol=1e-6):
                    wrong.append(f"{name}@tp{vtp}")
        adapted = {n for n, p in model.named_parameters() if hasattr(p, "lora_adapter")}
        wrong += [f"aliased {n}" for b in resharder.plan.buckets for n in b.alias.values() if n in adapted]
    # an adapters-only checkpoint saved at EP 2 resumes at EP 1 with expert TP 2 (fresh adapters overwritten)
    from alignment.models.lora_export import export_lora_adapters
    from alignment.training.checkpoint import load_megatron_checkpoint, save_megatron_checkpoint

    ckpt = save_megatron_checkpoint(model, Path(ckpt_dir) / "step_1", step=1)
    sizes = dict(tensor_model_parallel_size=2, sequence_parallel=True)
    init_distributed(ParallelLayout(world_size=world, **sizes))
    again = build_gpt_model(hf.config, transformer_config(hf.config, **sizes))
    load_hf_weights(again, state, bridge)
    apply_lora(again, SPEC)
    step = load_megatron_checkpoint(again, ckpt)
    back = export_lora_adapters(again, bridge)
    resumed = step == 1 and back.keys() == values.keys() and all(torch.equal(back[k], values[k]) for k in values)
    ranks = every_rank({"wrong": wrong[:3], "count": count, "resumed": resumed})  # rank 1's vLLM TP 2 shard too
    return {"sync_wrong": [w for r in ranks for w in r["wrong"]], "sync_tensors": [r["count"] for r in ranks],
            "sync_max_diff": worst_over_ranks(worst), "checkpoint_resumes": all(r["resumed"] for r in ranks),
            "merge_moves_experts": min((merged[k] - state[k]).abs().max().item() for k in state if ".experts." in k)}


def main(path: str) -> None:
    _, world, _ = env_world()
    results = {}
    # GRPO
    hf = grpo.tiny_llama(seed=3, tie_word_embeddings=False)
    state = {k: v.clone() for k, v in hf.state_dict().items()}
    values = adapter_values(hf)
    batch = grpo.make_batch(hf.config.vocab_size)
    ref_loss, ref_grads = grpo.hf_reference(peft_wrapped(hf, values), batch)
    want = expected(ref_grads)
    res = {"reference_loss": ref_loss, "reference_max_grad": max(g.abs().max().item() for g in want.values()),
           "tensors": len(want)}
    for name, sizes in LAYOUTS.items():
        loss, grads = grpo.megatron_case(hf, batch, world, 2, state=state, lora=SPEC, adapters=values, **sizes)
        res[name] = {"loss": loss, **compare(grads, want)}
    results["grpo"] = res
    # DPO
    lm, rm = offline.hf_models()
    state = {k: v.clone() for k, v in lm.state_dict().items()}
    values = adapter_values(lm)
    batch = offline.make_sequence_batch(offline.rows(lm.config.vocab_size, 8), offline.PAD)
    with torch.no_grad():  # a reference near the policy, so the loss is not saturated
        seq = (offline.hf_logps(lm, batch) * batch["loss_mask"]).sum(1)
    batch["ref_logps"] = seq + 0.5 * torch.randn(8, generator=torch.Generator().manual_seed(4))
    ref_loss, ref_grads = offline.reference("dpo", peft_wrapped(lm, values), rm, batch)
    want = expected(ref_grads)
    res = {"reference_loss": ref_loss, "reference_max_grad": max(g.abs().max().item() for g in want.values()),
           "tensors": len(want)}
    for name, sizes in LAYOUTS.items():
        tp, pp = sizes.get("tensor_model_parallel_size", 1), sizes.get("pipeline_model_parallel_size", 1)
        loss, grads, *_ = offline.megatron_case("dpo", lm, rm, batch, tp, pp, sizes.get("sequence_parallel", False), 1,
                                                1, "p2p", False, world, state=state, lora=SPEC, adapters=values)
        res[name] = {"loss": float(loss), **compare(grads, want)}
    results["dpo"] = res
    results["grpo_moe"] = moe_case(world, str(Path(path).with_suffix("")) + "_peft")
    write_results_and_shutdown(path, results)


if __name__ == "__main__":
    main(sys.argv[1])
    exit_now()
