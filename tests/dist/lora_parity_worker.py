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
"""

from __future__ import annotations

import sys

import torch

from parallel.lora import LoRASpec
from parallel.state import env_world
from tests.dist import grpo_invariance_worker as grpo
from tests.dist import offline_invariance_worker as offline
from tests.dist.report import write_results_and_shutdown

SPEC = LoRASpec(rank=4, alpha=8.0)
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
FUSED = {"k_proj": "q_proj", "v_proj": "q_proj", "up_proj": "gate_proj"}  # projection -> the one holding its A
LAYOUTS = {"dp2": dict(), "tp2": dict(tensor_model_parallel_size=2),
           "tp2_sp": dict(tensor_model_parallel_size=2, sequence_parallel=True),
           "pp2": dict(pipeline_model_parallel_size=2)}


def adapter_values(hf) -> dict[str, torch.Tensor]:
    """PEFT-named adapters for every target of ``hf`` (a causal LM), fused projections sharing A."""
    g = torch.Generator().manual_seed(21)
    out = {}
    for name, module in hf.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if leaf not in TARGETS:
            continue
        prefix = f"base_model.model.{name}"
        a = out.get(f"{prefix.rsplit('.', 1)[0]}.{FUSED[leaf]}.lora_A.weight") if leaf in FUSED else None
        out[f"{prefix}.lora_A.weight"] = a if a is not None else 0.3 * torch.randn(SPEC.rank, module.in_features,
                                                                                    generator=g)
        out[f"{prefix}.lora_B.weight"] = 0.1 * torch.randn(module.out_features, SPEC.rank, generator=g)
    return out


def peft_wrapped(hf, values):
    from peft import LoraConfig, get_peft_model, set_peft_model_state_dict

    model = get_peft_model(hf, LoraConfig(r=SPEC.rank, lora_alpha=SPEC.alpha, lora_dropout=0.0,
                                          target_modules=TARGETS))
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
    """The largest absolute difference, and the largest relative to its tensor's largest gradient."""
    assert set(grads) == set(want), sorted(set(grads) ^ set(want))
    diff = {k: (grads[k] - want[k]).abs().max().item() for k in grads}
    rel = {k: diff[k] / max(want[k].abs().max().item(), 1e-12) for k in grads}
    worst = max(rel, key=rel.get)
    return {"max_grad_diff": max(diff.values()), "max_rel_diff": rel[worst], "worst": worst}


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
    write_results_and_shutdown(path, results)


if __name__ == "__main__":
    main(sys.argv[1])
