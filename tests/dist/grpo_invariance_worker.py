"""torchrun worker (2 processes): GRPO gradients through Megatron equal plain autograd.

For one fixed global batch (8 sequences of uneven lengths, random advantages, reference
logprobs, masks, some with a hole: a multi-turn episode's tool tokens), the gradient of the GRPO
loss computed by
``alignment.training.megatron_step.forward_backward`` (Megatron DDP + schedule) must
equal the gradient of the same loss computed by plain autograd on the HF
``transformers`` model over the whole batch in one process, for:
  DP=2 with micro-batch sizes 1, 2 and 4; TP=2 (DP=1) with micro-batch 2 and 4; TP=2 with sequence
  parallelism (norm gradients all-reduced over TP); PP=2 (DP=1) with micro-batch 2; and with the
  output layer on the response positions only (``positions="response_mask"``) at DP=2, DP=2 packed,
  TP=2, TP=2 with sequence parallelism (where it is not applied) and PP=2. Also, for a batch of two
  prompts with four responses each, shared-prompt packing (``share_prompts``, parallel/prompt_tree.py:
  one tree per prompt in a micro-batch) at DP=2 (one tree, and two trees of two responses, per
  rank), TP=2 (one and two trees per micro-batch), PP=2 (trees padded to one length), and scoring
  every position. On-policy distillation's terms (:func:`alignment.trainers.distill.distill_terms`) added to the
  GRPO loss: GKD's JSD of the whole distributions (:class:`VocabOutputs`) at DP=2, TP=2, TP=2 on the response
  positions only, and PP=2, and the reverse-KL advantages at TP=2.
Writes {case: {"loss": float, "max_grad_diff": float, "max_grad": float}} + the reference loss.
"""

from __future__ import annotations

import copy
import sys
from types import SimpleNamespace

import torch
import torch.distributed as dist

from alignment.algorithms.grpo_loss import GRPOLossConfig, grpo_loss
from alignment.data.images import select_rows
from alignment.models.families import get_bridge
from alignment.models.gpt import build_gpt_model, transformer_config
from alignment.models.weights import export_hf_weights, load_hf_weights
from alignment.training.batching import split_microbatches
from alignment.trainers.distill import distill_terms
from alignment.training.routing_replay import RoutingPass, agreement_metrics
from alignment.training.megatron_step import (LogprobOutputs, OptimConfig, VocabOutputs, forward_backward,
                                              setup_training)
from parallel.layout import ParallelLayout
from parallel.state import env_world, init_distributed
from tests.dist.report import worst_over_ranks, write_results_and_shutdown, exit_now
from tests.dist.tiny_llama import tiny_llama

CFG = GRPOLossConfig(clip_ratio=0.2, kl_coef=0.1, kl_estimator="k3")
# name: (tp, pp, micro-batch size, sequence parallel, packing, output positions)
CASES = {"dp2_mbs1": (1, 1, 1, False, False, None), "dp2_mbs2": (1, 1, 2, False, False, None),
         "dp2_mbs4": (1, 1, 4, False, False, None), "tp2_mbs2": (2, 1, 2, False, False, None),
         "tp2_mbs4": (2, 1, 4, False, False, None), "tp2_sp_mbs2": (2, 1, 2, True, False, None),
         "pp2_mbs2": (1, 2, 2, False, False, None),
         "dp2_mbs2_response_only": (1, 1, 2, False, False, "response_mask"),
         "dp2_mbs4_packed_response_only": (1, 1, 4, False, True, "response_mask"),
         "tp2_mbs2_response_only": (2, 1, 2, False, False, "response_mask"),
         "tp2_sp_mbs2_response_only": (2, 1, 2, True, False, "response_mask"),
         "pp2_mbs2_response_only": (1, 2, 2, False, False, "response_mask")}
# distillation: name: (tp, pp, micro-batch size, output positions, loss)
DISTILL_CASES = {"distill_jsd_dp2_mbs2": (1, 1, 2, None, "jsd"), "distill_jsd_tp2_mbs2": (2, 1, 2, None, "jsd"),
                 "distill_jsd_tp2_response_only": (2, 1, 2, "response_mask", "jsd"),
                 "distill_jsd_pp2_mbs2": (1, 2, 2, None, "jsd"),
                 "distill_reverse_kl_tp2_mbs2": (2, 1, 2, None, "reverse_kl")}
# shared-prompt packing on GROUP_BATCH: name: (tp, pp, micro-batch size, output positions)
SHARED_CASES = {"shared_dp2_mbs4": (1, 1, 4, "response_mask"), "shared_dp2_mbs2": (1, 1, 2, "response_mask"),
                "shared_tp2_mbs4": (2, 1, 4, "response_mask"), "shared_tp2_mbs8": (2, 1, 8, "response_mask"),
                "shared_pp2_mbs2": (1, 2, 2, "response_mask"), "shared_dp2_mbs4_all_positions": (1, 1, 4, None)}


def make_batch(vocab: int):
    g = torch.Generator().manual_seed(5)
    n, seq = 8, 12
    ids = torch.randint(0, vocab, (n, seq), generator=g)
    mask = torch.zeros(n, seq)
    for i in range(n):  # prompts of 3-5 tokens, responses of uneven length
        p = 3 + i % 3
        mask[i, p - 1 : p - 1 + 2 + (i * 5) % 7] = 1.0
        if 2 + (i * 5) % 7 >= 5:  # a multi-turn episode: its second response token came from a tool
            mask[i, p] = 0.0
    return {"input_ids": ids, "position_ids": torch.arange(seq).expand(n, seq).contiguous(),
            "response_mask": mask,
            # "old" logprobs slightly off the current ones, so ratios != 1 and some clip
            "old_delta": 0.3 * torch.randn(n, seq, generator=g),
            "ref_logprobs": -5.5 + 0.5 * torch.randn(n, seq, generator=g),
            "advantages": torch.randn(n, generator=g)}


def make_group_batch(vocab: int):
    """Two prompts (4 and 5 tokens) with four responses each (3, 1, 6, 2 and 4, 7, 1, 5 tokens),
    right-padded to 12, with ``seq_lengths`` and ``response_lengths`` (what shared-prompt packing reads)."""
    g = torch.Generator().manual_seed(7)
    n, seq = 8, 12
    ids = torch.zeros(n, seq, dtype=torch.long)
    mask = torch.zeros(n, seq)
    prompts = [torch.randint(1, vocab, (p,), generator=g) for p in (4, 5)]
    responses = (3, 1, 6, 2, 4, 7, 1, 5)
    for i, r in enumerate(responses):
        prompt = prompts[i // 4]
        p = prompt.numel()
        ids[i, :p] = prompt
        ids[i, p : p + r] = torch.randint(1, vocab, (r,), generator=g)
        mask[i, p - 1 : p - 1 + r] = 1.0
    lengths = torch.tensor(responses)
    return {"input_ids": ids, "response_mask": mask, "response_lengths": lengths,
            "seq_lengths": lengths + torch.tensor([4] * 4 + [5] * 4),
            "old_delta": 0.3 * torch.randn(n, seq, generator=g),
            "ref_logprobs": -5.5 + 0.5 * torch.randn(n, seq, generator=g),
            "advantages": torch.randn(n, generator=g)}


def distill_batch(batch: dict, vocab: int, loss: str) -> dict:
    """``batch`` with a teacher's scores: ``teacher_vocab_logprobs`` ``[n, seq, V]`` (a random distribution
    per position) for ``jsd``, ``teacher_logprobs`` ``[n, seq]`` for ``reverse_kl``."""
    g = torch.Generator().manual_seed(11)
    teacher = torch.log_softmax(2 * torch.randn(*batch["input_ids"].shape, vocab, generator=g), -1)
    if loss == "reverse_kl":
        return {**batch, "teacher_logprobs": teacher[..., 0]}
    return {**batch, "teacher_vocab_logprobs": teacher}


def hf_reference(hf, batch, extra_loss=None, distill=None, **forward_kwargs):
    """GRPO loss (plus ``distill``'s terms: an ``algorithm`` namespace) and HF-named gradients by plain
    autograd over the full batch; ``extra_loss(output)`` is added to what is differentiated (not to the
    returned loss)."""
    hf.zero_grad()
    output = hf(batch["input_ids"], **forward_kwargs)
    logits = output.logits.float()
    full = torch.log_softmax(logits, -1)
    full = torch.cat([full[:, :-1], full.new_zeros(full.shape[0], 1, full.shape[2])], 1)
    lp = full[:, :-1].gather(-1, batch["input_ids"][:, 1:, None])[..., 0]
    lp = torch.cat([lp, lp.new_zeros(lp.shape[0], 1)], 1)
    total = batch["response_mask"].sum()
    old = lp.detach() + batch["old_delta"]
    advantages, extra, _ = (distill_terms(batch, {"vocab_logprobs": full}, old, total, distill) if distill
                            else (batch["advantages"], None, {}))
    loss, _ = grpo_loss(lp, old, batch["ref_logprobs"], advantages, batch["response_mask"], total, CFG)
    if extra is not None:
        loss = loss + extra
    value = loss.item()
    (loss if extra_loss is None else loss + extra_loss(output)).backward()
    return value, {k: p.grad.clone() for k, p in hf.named_parameters() if p.grad is not None}


def megatron_case(hf, batch, world, mbs, state=None, moe_aux_loss_coeff=0.0, router_stats=False, packing=False,
                  positions=None, share_prompts=False, lora=None, adapters=None, peft_dir=None, local_normaliser=False,
                  distill=None, routing=None, params_dtype=torch.float32, **sizes):
    """Loss and HF-named (checkpoint form) gradients of the GRPO loss through Megatron, laid out
    with ``sizes`` (ParallelLayout fields), micro-batches of ``mbs`` rows; weights from ``state``
    (HF checkpoint form, default the model's state dict). ``router_stats``: also return the
    step's :func:`alignment.training.router_stats.routing_metrics`. ``packing``, ``positions``,
    ``share_prompts``: as :func:`alignment.training.megatron_step.forward_backward`'s. ``lora``: a
    :class:`parallel.lora.LoRASpec` whose adapters start from ``adapters`` (PEFT-named): the
    gradients returned are then the adapters' (PEFT-named, :func:`export_lora_adapters`), and
    ``peft_dir`` receives the adapters as a PEFT directory (:func:`save_peft_adapter`).
    ``local_normaliser``: the bug the invariance rules out, each rank dividing by its own token
    count instead of the global one (the negative control). ``distill``: an ``algorithm`` namespace whose
    distillation terms join the loss (:func:`alignment.trainers.distill.distill_terms`). ``routing``: the MoE
    routers ``record`` their experts, or ``replay`` / ``compare`` the batch's ``routed_experts``
    (:class:`alignment.training.routing_replay.RoutingPass`); then also returns ``{"recorded": this rank's
    rows' table or None, "moe/routing_agreement": ...}``. ``params_dtype``: the model's weights and
    compute (bf16: Megatron's mixed precision, fp32 gradient buffers)."""
    from megatron.core import parallel_state as ps

    from alignment.training.router_stats import routing_metrics

    init_distributed(ParallelLayout(world_size=world, **sizes))
    cfg = hf.config
    model = build_gpt_model(cfg, transformer_config(cfg, moe_aux_loss_coeff=moe_aux_loss_coeff,
                                                    params_dtype=params_dtype, **sizes))
    bridge = get_bridge(cfg)
    load_hf_weights(model, hf.state_dict() if state is None else state, bridge)
    if lora is not None:
        from alignment.models.lora_export import load_lora_adapters
        from parallel.lora import apply_lora

        apply_lora(model, lora)
        load_lora_adapters(model, bridge, adapters)
    ddp, _ = setup_training(model, OptimConfig())  # (MoE: tracks routing, alignment.training.router_stats)
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    rows = batch["input_ids"].shape[0] // dp
    local = select_rows(batch, torch.arange(dp_rank * rows, (dp_rank + 1) * rows))  # with its rows' images
    total = (local if local_normaliser else batch)["response_mask"].sum()  # the global normaliser, passed in

    def loss_fn(mb, out):
        lp = out["logprobs"]
        old = lp.detach() + mb["old_delta"]
        advantages, extra, _ = (distill_terms(mb, out, old, total, distill) if distill
                                else (mb["advantages"], None, {}))
        loss, m = grpo_loss(lp, old, mb["ref_logprobs"], advantages, mb["response_mask"], total, CFG)
        m["extra_sum"] = torch.zeros(()) if extra is None else extra.detach() * total
        return (loss, m) if extra is None else (loss + extra, m)

    ddp.zero_grad_buffer()
    vocab = cfg.get_text_config().vocab_size
    outputs = VocabOutputs(vocab) if distill else LogprobOutputs(vocab)
    routes = RoutingPass.of(ddp, routing) if routing else None
    out = forward_backward(ddp, split_microbatches(local, mbs), loss_fn, forward_only=False,
                           outputs=outputs, packing=packing, positions=positions, share_prompts=share_prompts,
                           routing=routes)
    loss = torch.tensor(sum(o["policy_loss_sum"].item() + CFG.kl_coef * o["kl_sum"].item() + o["extra_sum"].item()
                            for o in out)
                        if ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == 0
                        and ps.get_context_parallel_rank() == 0 else 0.0,  # CP ranks each hold the whole loss
                        dtype=torch.float64)
    dist.all_reduce(loss)
    if lora is not None:
        from alignment.models.lora_export import export_lora_adapters

        grads = export_lora_adapters(ddp, bridge, source=lambda p: p.main_grad)
        if peft_dir is not None:
            from alignment.models.lora_export import save_peft_adapter

            save_peft_adapter(ddp, bridge, lora, "base", peft_dir)
    else:
        grads = export_hf_weights(ddp, bridge, source=lambda p: p.main_grad)
    if router_stats:
        return loss.item() / total.item(), grads, routing_metrics(ddp)
    if routes is not None:
        return loss.item() / total.item(), grads, {
            "recorded": routes.recorded_rows() if routing == "record" else None, **agreement_metrics(ddp)}
    return loss.item() / total.item(), grads


def tp_attributes(hf, initialize: bool) -> dict:
    """``{name: (tensor_model_parallel, partition_dim, partition_stride)}`` of a TP=2 shard built
    with or without Megatron's random initialisation (alignment.models.gpt.mark_tensor_parallel_weights)."""
    init_distributed(ParallelLayout(world_size=env_world()[1], tensor_model_parallel_size=2))
    model = build_gpt_model(hf.config, transformer_config(hf.config, tensor_model_parallel_size=2, initialize=initialize))
    return {n: tuple(getattr(p, a, None) for a in ("tensor_model_parallel", "partition_dim", "partition_stride"))
            for n, p in model.named_parameters()}


def main(path: str) -> None:
    rank, world, _ = env_world()
    hf = tiny_llama(seed=3, tie_word_embeddings=False)
    initialised, loaded_only = tp_attributes(hf, True), tp_attributes(hf, False)
    batch = make_batch(hf.config.vocab_size)
    ref_loss, ref_grads = hf_reference(hf, batch)
    results = {"reference_loss": ref_loss,
               "reference_max_grad": max(g.abs().max().item() for g in ref_grads.values()),
               "tp_split_weights": sum(bool(a[0]) for a in initialised.values()),
               "tp_attribute_mismatches": sorted(n for n in initialised if initialised[n] != loaded_only[n])}
    for name, (tp, pp, mbs, sp, packing, positions) in CASES.items():
        loss, grads = megatron_case(hf, batch, world, mbs, tensor_model_parallel_size=tp,
                                    pipeline_model_parallel_size=pp, sequence_parallel=sp, packing=packing,
                                    positions=positions)
        assert set(grads) == set(ref_grads), sorted(set(ref_grads) ^ set(grads))
        diff = max((grads[k] - ref_grads[k]).abs().max().item() for k in grads)
        results[name] = {"loss": loss, "max_grad_diff": worst_over_ranks(diff)}
    loss, grads = megatron_case(hf, batch, world, 2, tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                                local_normaliser=True)  # negative control: must miss the tolerance
    results["dp2_mbs2_local_normaliser"] = {"loss": loss, "max_grad_diff": worst_over_ranks(
        max((grads[k] - ref_grads[k]).abs().max().item() for k in grads))}
    distill_grads = {}  # loss kind -> the single-process reference gradients
    for name, (tp, pp, mbs, positions, kind) in DISTILL_CASES.items():
        algorithm = SimpleNamespace(distill_loss=kind, distill_beta=0.3, loss_agg_mode="token-mean")
        data = distill_batch(batch, hf.config.vocab_size, kind)
        if kind not in distill_grads:
            value, distill_grads[kind] = hf_reference(hf, data, distill=algorithm)
            results[f"distill_{kind}_reference"] = {
                "loss": value, "max_grad": max(g.abs().max().item() for g in distill_grads[kind].values())}
        loss, grads = megatron_case(hf, data, world, mbs, tensor_model_parallel_size=tp,
                                    pipeline_model_parallel_size=pp, positions=positions, distill=algorithm)
        results[name] = {"loss": loss, "max_grad_diff": worst_over_ranks(
            max((grads[k] - distill_grads[kind][k]).abs().max().item() for k in grads))}
    groups = make_group_batch(hf.config.vocab_size)
    group_loss, group_grads = hf_reference(hf, groups)
    results["group_reference"] = {"loss": group_loss,
                                  "max_grad": max(g.abs().max().item() for g in group_grads.values())}
    for name, (tp, pp, mbs, positions) in SHARED_CASES.items():
        loss, grads = megatron_case(hf, groups, world, mbs, tensor_model_parallel_size=tp,
                                    pipeline_model_parallel_size=pp, positions=positions, share_prompts=True)
        results[name] = {"loss": loss, "max_grad_diff": worst_over_ranks(
            max((grads[k] - group_grads[k]).abs().max().item() for k in grads))}
    results.update(bf16_cases(hf, batch, world))
    write_results_and_shutdown(path, results)


def bf16_cases(hf, batch, world: int) -> dict:
    """bf16 weights and compute (Megatron's mixed precision) against fp32 autograd on the same
    weights (the fp32 reference loads the bf16-rounded weights, so only the arithmetic differs), at
    DP 2 and TP 2: the loss's relative error and, per tensor, ``max|g_bf16 - g_fp32| / max|g_fp32|``
    (the worst tensor, over all ranks)."""
    rounded = copy.deepcopy(hf)
    with torch.no_grad():
        for p in rounded.parameters():
            p.copy_(p.bfloat16().float())
    ref_loss, ref_grads = hf_reference(rounded, batch)
    state = {k: v.clone() for k, v in rounded.state_dict().items()}
    results = {}
    for name, tp in (("bf16_dp2_mbs2", 1), ("bf16_tp2_mbs2", 2)):
        loss, grads = megatron_case(rounded, batch, world, 2, state=state, params_dtype=torch.bfloat16,
                                    tensor_model_parallel_size=tp)
        rel = max((grads[k].float() - ref_grads[k]).abs().max().item() / max(ref_grads[k].abs().max().item(), 1e-12)
                  for k in ref_grads)
        results[name] = {"loss_rel_diff": abs(loss - ref_loss) / abs(ref_loss),
                         "max_rel_grad_diff": worst_over_ranks(rel),
                         "tensors": len(grads)}
    return results


if __name__ == "__main__":
    main(sys.argv[1])
    exit_now()
