"""torchrun worker: Megatron logits == HF transformers logits for several layouts.

Run: torchrun --nproc-per-node 2 tests/dist/parity_worker.py OUT.json
Writes {layout_name: {"max_abs_diff": float, "export_max_abs_diff": float}} from rank 0.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

from alignment.models.families import get_bridge
from alignment.models.gpt import build_gpt_model, transformer_config
from alignment.models.weights import export_hf_weights, load_hf_weights
from alignment.training.megatron_step import forward_backward
from parallel.layout import ParallelLayout
from parallel.state import env_world, init_distributed
from tests.dist.report import every_rank, worst_over_ranks, write_results_and_shutdown, exit_now
from tests.dist.tiny_llama import tiny_llama

LAYOUTS = {"tp1": (1, 1, False), "tp2": (2, 1, False), "tp2_sp": (2, 1, True), "pp2": (1, 2, False)}


def sizes(tp, pp, sp):
    return dict(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, sequence_parallel=sp)


@torch.no_grad()
def randomize(model) -> None:
    """Give a Megatron shard its own random weights (not from HF): the same on every rank
    for replicated parameters, different per TP rank for TP-split ones."""
    from megatron.core import parallel_state as ps

    from parallel.names import global_param_names

    for _, gname, p in global_param_names(model):
        split = getattr(p, "tensor_model_parallel", False)
        if gname == "output_layer.weight" and model.share_embeddings_and_output_weights:
            gname = "embedding.word_embeddings.weight"  # PP>1: the last stage's copy of the tied embedding
        seed = sum(map(ord, gname)) * 7 + (ps.get_tensor_model_parallel_rank() if split else 0)
        g = torch.Generator().manual_seed(seed)
        if p.dim() == 1:
            p.copy_(0.5 + torch.rand(p.shape, generator=g))
        else:
            p.copy_(0.1 * torch.randn(p.shape, generator=g))


def megatron_logits(hf_model, input_ids, world, own_weights=False, state=None, dtype=torch.float32, **sizes):
    """Logits of a Megatron shard of ``hf_model`` laid out with ``sizes`` (ParallelLayout fields), full
    vocabulary on the last stage (None elsewhere), and its HF export. Weights from ``state`` (the HF
    checkpoint form; default the model's state dict) or, with ``own_weights``, random ones; the
    model's parameters in ``dtype`` (bf16: Megatron's mixed precision, as a job's)."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    from alignment.models.families import model_dims
    from parallel.layout import validate_model_layout

    layout = ParallelLayout(world_size=world, **sizes)
    cfg = hf_model.config
    validate_model_layout(layout, model_dims(cfg))
    init_distributed(layout)
    bridge = get_bridge(cfg)
    model = build_gpt_model(cfg, transformer_config(cfg, params_dtype=dtype, **sizes)).eval()
    ref = hf_model.state_dict() if state is None else state
    if own_weights:
        randomize(model)
    else:
        load_hf_weights(model, ref, bridge)
    mb = {"input_ids": input_ids, "position_ids": torch.arange(input_ids.shape[1]).expand_as(input_ids)}

    def full_logits(logits, target_ids):
        return {"logits": gather_from_tensor_model_parallel_region(logits)[..., : cfg.vocab_size]}

    with torch.no_grad():
        out = forward_backward(model, [mb], lambda mb, o: (o["logits"].sum() * 0, o), outputs=full_logits,
                               forward_only=True)
    exported = export_hf_weights(model, bridge)
    logits = out[0]["logits"] if ps.is_pipeline_last_stage() else None
    if own_weights:
        return logits, exported
    export_diff = max((exported[k] - ref[k]).abs().max().item() for k in exported)
    missing = sorted(set(ref) - set(exported) - ({"lm_head.weight"} if cfg.tie_word_embeddings else set()))
    return logits, export_diff, missing


def max_diff_on_last_stage(logits, ref) -> float:
    diff = torch.tensor((logits - ref).abs().max().item() if logits is not None else 0.0)
    dist.all_reduce(diff, op=dist.ReduceOp.MAX)
    return diff.item()


def main(path: str) -> None:
    rank, world, _ = env_world()
    results = {}
    for tie in (False, True):
        hf = tiny_llama(seed=1, tie_word_embeddings=tie)
        torch.manual_seed(2)
        input_ids = torch.randint(0, hf.config.vocab_size, (2, 12))
        with torch.no_grad():
            ref = hf(input_ids).logits
        for name, (tp, pp, sp) in LAYOUTS.items():
            logits, export_diff, missing = megatron_logits(hf, input_ids, world, **sizes(tp, pp, sp))
            results[f"{name}{'_tied' if tie else ''}"] = {
                "max_abs_diff": max_diff_on_last_stage(logits, ref), "export_max_abs_diff": worst_over_ranks(export_diff),
                "export_missing": sorted({m for ms in every_rank(missing) for m in ms}), "ref_logit_std": ref.std().item()}
        # Export on its own: a Megatron model with its own weights -> HF -> transformers logits.
        for name, (tp, pp, sp) in LAYOUTS.items():
            logits, exported = megatron_logits(hf, input_ids, world, own_weights=True, **sizes(tp, pp, sp))
            fresh = type(hf)(hf.config).eval()
            fresh.load_state_dict(exported, strict=not tie)
            with torch.no_grad():
                hf_logits = fresh(input_ids).logits
            results[f"export_{name}{'_tied' if tie else ''}"] = {
                "max_abs_diff": max_diff_on_last_stage(logits, hf_logits), "ref_logit_std": hf_logits.std().item()}
    # bf16 on the CPU (Megatron's bf16 against transformers' fp32 logits): bf16 keeps 8 bits of mantissa
    # and the two sides round differently, so the measure is transformers' own bf16 error (a job's
    # model.dtype=bfloat16)
    hf = tiny_llama(seed=1, tie_word_embeddings=False)
    torch.manual_seed(2)
    input_ids = torch.randint(0, hf.config.vocab_size, (2, 12))
    with torch.no_grad():
        ref = hf(input_ids).logits
        hf16 = tiny_llama(seed=1, tie_word_embeddings=False).to(torch.bfloat16).eval()
        err_hf16 = (hf16(input_ids).logits.float() - ref).abs().max().item()
    for name, (tp, pp, sp) in (("tp1", LAYOUTS["tp1"]), ("tp2", LAYOUTS["tp2"])):
        logits, _, _ = megatron_logits(hf, input_ids, world, dtype=torch.bfloat16, **sizes(tp, pp, sp))
        results[f"bf16_{name}"] = {"max_abs_diff": max_diff_on_last_stage(logits.float(), ref),
                                   "transformers_bf16_diff": err_hf16, "dtype": str(logits.dtype),
                                   "ref_logit_std": ref.std().item()}
    write_results_and_shutdown(path, results)


if __name__ == "__main__":
    main(sys.argv[1])
    exit_now()
