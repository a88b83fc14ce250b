"""torchrun worker: Qwen3 and Qwen3-MoE on Megatron equal transformers, for many layouts.

    torchrun --nproc-per-node 2 tests/dist/family_worker.py OUT.json     # the 2-rank layouts + gradients
    torchrun --nproc-per-node 4 tests/dist/family_worker.py OUT.json     # EP x TP layouts on 4 ranks

Logits (fp32, full vocabulary) of tiny random models loaded from their HF checkpoint form
must equal transformers' (``max_abs_diff``), and the HF export must give every checkpoint
tensor back exactly (``export_max_abs_diff``, ``export_missing``). On 2 ranks also: GRPO-loss
gradients of Qwen3-MoE at EP=2 (and EP=1, TP=2+SP) against plain autograd on the HF model over
the whole batch, and, with the load-balancing loss on, EP=1 vs EP=2 gradients and aux losses; and
MoE routing replay (:func:`routing_cases`, and R3 through the Megatron engine at EP=2:
:func:`rollout_routing_case`).
Writes {case: {...}}.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager

import torch
import torch.distributed as dist

from alignment.models.families import get_bridge
from alignment.models.gpt import build_gpt_model, transformer_config
from alignment.models.weights import load_hf_weights
from alignment.data.samples import SamplingConfig
from alignment.rollout.engines.megatron_engine import MegatronEngine
from alignment.trainers.rl_phases import policy_logprobs
from alignment.training.batching import make_batch as rollout_batch
from alignment.training.batching import split_microbatches
from alignment.training.megatron_step import OptimConfig, setup_training
from alignment.training.routing_replay import REPLAY, RoutingPass, agreement_metrics
from parallel.layout import ParallelLayout
from parallel.names import unwrap
from parallel.state import env_world, init_distributed
from tests.dist.grpo_invariance_worker import hf_reference, make_batch, megatron_case
from tests.dist.parity_worker import max_diff_on_last_stage, megatron_logits
from tests.dist.report import write_results_and_shutdown, exit_now
from tests.dist.tiny_models import checkpoint_state, tiny_qwen3, tiny_qwen3_moe


def L(tp=1, pp=1, ep=1, etp=None):  # noqa: N802 - a layout, as ParallelLayout fields
    return dict(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, sequence_parallel=tp > 1,
                expert_model_parallel_size=ep, expert_tensor_parallel_size=etp)


LOGIT_CASES = {
    2: {"qwen3/tp1": L(), "qwen3/tp2": L(tp=2), "qwen3/pp2": L(pp=2), "qwen3_tied/tp2": L(tp=2),
        "qwen3_tied/pp2": L(pp=2),
        "qwen3_moe/ep1": L(), "qwen3_moe/ep2": L(ep=2), "qwen3_moe/tp2": L(tp=2),
        "qwen3_moe/tp2_ep2_etp1": L(tp=2, ep=2, etp=1), "qwen3_moe/pp2": L(pp=2)},
    4: {"qwen3_moe/ep2_tp2": L(tp=2, ep=2), "qwen3_moe/ep4": L(ep=4), "qwen3_moe/pp2_ep2": L(pp=2, ep=2),
        "qwen3_moe/pp2_tp2_ep2_etp1": L(tp=2, pp=2, ep=2, etp=1)},
}
MODELS = {"qwen3": lambda: tiny_qwen3(seed=1), "qwen3_tied": lambda: tiny_qwen3(seed=1, tie_word_embeddings=True),
          "qwen3_moe": lambda: tiny_qwen3_moe(seed=1)}


def logit_cases(world: int) -> dict:
    results = {}
    torch.manual_seed(2)
    input_ids = torch.randint(0, 250, (2, 12))
    for name, sizes in LOGIT_CASES[world].items():
        hf = MODELS[name.split("/")[0]]()
        with torch.no_grad():
            ref = hf(input_ids).logits
        logits, export_diff, missing = megatron_logits(hf, input_ids, world, state=checkpoint_state(hf), **sizes)
        results[name] = {"max_abs_diff": max_diff_on_last_stage(logits, ref), "export_max_abs_diff": export_diff,
                         "export_missing": missing, "ref_logit_std": ref.std().item()}
    return results


AUX_COEFF = 0.05
GRAD_CASES = {  # name: (sizes, micro-batch rows, load-balancing loss coefficient)
    "grad/ep1": (L(), 2, 0.0), "grad/ep2": (L(ep=2), 2, 0.0), "grad/tp2_ep2_etp1": (L(tp=2, ep=2, etp=1), 4, 0.0),
    "grad_aux/ep1": (L(), 4, AUX_COEFF), "grad_aux/ep2": (L(ep=2), 4, AUX_COEFF),
}


def switch_aux(router_logits: torch.Tensor, topk: int, groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Megatron's switch load-balancing loss per micro-batch (``E * sum_i f_i P_i``, f_i = share of
    the top-k assignments, P_i = mean router probability), averaged over ``groups`` equal
    micro-batches of the rows, computed from HF's router logits ``[tokens, E]``; and the
    per-expert assignment counts ``[E]``."""
    e = router_logits.shape[-1]
    aux, counts = 0.0, torch.zeros(e)
    for chunk in router_logits.float().chunk(groups):
        probs = torch.softmax(chunk, dim=-1)
        chosen = probs.topk(topk, dim=-1).indices.flatten()
        c = torch.zeros(e).scatter_add_(0, chosen, torch.ones(chosen.numel()))
        aux = aux + e * ((c / (chunk.shape[0] * topk)) * probs.mean(0)).sum() / groups
        counts += c
    return aux, counts


def grad_cases(world: int) -> dict:
    """GRPO gradients of Qwen3-MoE through Megatron vs autograd on the HF model (whole batch, one
    process); with the load-balancing loss, the HF side adds ``coeff x sum over MoE layers`` of the
    switch loss of each rank's micro-batch, averaged (DP=2 ranks x 4 rows = one micro-batch each)."""
    hf = tiny_qwen3_moe(seed=3)
    batch, topk = make_batch(hf.config.vocab_size), hf.config.num_experts_per_tok
    per_layer = []

    def aux_loss(output):
        per_layer.clear()
        per_layer.extend(switch_aux(r, topk, 2) for r in output.router_logits)  # [rows * seq, E], row-major
        return AUX_COEFF * sum(a for a, _ in per_layer)

    refs = {0.0: hf_reference(hf, batch), AUX_COEFF: hf_reference(hf, batch, aux_loss, output_router_logits=True)}
    imbalance = torch.stack([c.max() / c.mean() for _, c in per_layer])
    router = [k for k in checkpoint_state(hf) if k.endswith("mlp.gate.weight")]
    with_aux, without = checkpoint_state(hf, refs[AUX_COEFF][1]), checkpoint_state(hf, refs[0.0][1])
    results = {"grad_reference": {"loss": refs[0.0][0],
                                  "aux_router_grad_effect": max((with_aux[k] - without[k]).abs().max().item()
                                                                for k in router),
                                  "max_grad": max(g.abs().max().item() for g in refs[0.0][1].values()),
                                  "aux_loss": torch.stack([a for a, _ in per_layer]).mean().item(),
                                  "load_imbalance": imbalance.mean().item(),
                                  "load_imbalance_max": imbalance.max().item()}}
    state = checkpoint_state(hf)
    for name, (sizes, mbs, coeff) in GRAD_CASES.items():
        ref_loss, ref_grads = refs[coeff]
        ref_grads = checkpoint_state(hf, ref_grads)
        loss, grads, metrics = megatron_case(hf, batch, world, mbs, state=state, moe_aux_loss_coeff=coeff,
                                             router_stats=True, **sizes)
        assert set(grads) == set(ref_grads), sorted(set(ref_grads) ^ set(grads))
        results[name] = {"loss": loss, "reference_loss": ref_loss, **metrics,
                         "max_grad_diff": max((grads[k] - ref_grads[k]).abs().max().item() for k in grads),
                         "max_router_grad_diff": max((grads[k] - ref_grads[k]).abs().max().item()
                                                     for k in grads if k.endswith("mlp.gate.weight"))}
    return results


ROUTING_CASES = {  # name: (sizes, micro-batch rows); every case replays one forced routing table
    "routing/ep1": (L(), 2), "routing/ep2": (L(ep=2), 2), "routing/tp2_sp_ep2_etp1": (L(tp=2, ep=2, etp=1), 4),
    "routing/pp2": (L(pp=2), 2)}


@contextmanager
def hf_routing(hf, forced: torch.Tensor | None = None):
    """Within the block, the experts every HF router would choose are appended to the yielded list (one
    ``[tokens, k]`` per MoE layer and forward, tokens row-major); with ``forced`` (``[rows, seq, layers,
    k]``) the routers then take those experts instead, weighted by their renormalised softmax
    probabilities (what Megatron's replay computes)."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    chosen, handles = [], []
    for i, layer in enumerate(hf.model.layers):
        gate = getattr(layer.mlp, "gate", None)
        if not isinstance(gate, Qwen3MoeTopKRouter):
            continue

        def hook(module, args, output, i=i):
            logits, scores, indices = output
            chosen.append(indices)
            if forced is not None:
                indices = forced[:, :, i].reshape(-1, forced.shape[-1]).long()
                scores = torch.softmax(logits.float().gather(1, indices), -1).to(logits.dtype)
            return logits, scores, indices

        handles.append(gate.register_forward_hook(hook))
    try:
        yield chosen
    finally:
        for h in handles:
            h.remove()


def routing_cases(world: int) -> dict:
    """MoE routing replay (alignment/training/routing_replay.py): the experts recorded through Megatron
    (EP=1, DP=2) equal HF's router choices; a forced table (a third of the tokens sent to the two experts
    they did not choose, in every MoE layer) replayed at every layout gives the loss and gradients of the
    HF model forced to the same experts, and each layout's ``moe/routing_agreement`` is the share of
    (token, layer) pairs left alone; ``compare`` keeps the model's own routing (the unforced loss)."""
    hf = tiny_qwen3_moe(seed=3)
    batch, state = make_batch(hf.config.vocab_size), checkpoint_state(hf)
    rows, seq = batch["input_ids"].shape
    with hf_routing(hf) as own:
        unforced_loss, unforced_grads = hf_reference(hf, batch)
    unforced_grads = checkpoint_state(hf, unforced_grads)
    _, _, info = megatron_case(hf, batch, world, 2, state=state, routing="record")
    parts = [None] * world
    dist.all_gather_object(parts, info["recorded"])
    table = torch.cat(parts)  # EP=1, DP=2: the global ranks are the data-parallel ranks
    moe = [i for i in range(hf.config.num_hidden_layers) if (table[:, :, i] >= 0).all()]
    mismatches = sum(int((table[:, :, i].reshape(-1, 2).long().sort(-1).values
                          != o.sort(-1).values).any(-1).sum()) for i, o in zip(moe, own))
    forced, experts = table.clone().long(), hf.config.num_experts
    pick = (torch.arange(rows * seq) % 3 == 0).view(rows, seq)
    for i in moe:  # the two experts a token did not choose (4 experts, top-2)
        others = torch.stack([torch.tensor([e for e in range(experts) if e not in set(t.tolist())])
                              for t in forced[:, :, i].reshape(-1, 2)]).view(rows, seq, 2)
        forced[:, :, i] = torch.where(pick[..., None], others, forced[:, :, i])
    with hf_routing(hf, forced) as own_forced:  # forcing a layer moves the later layers' own choices too
        ref_loss, ref_grads = hf_reference(hf, batch)
    agreeing = sum(int((forced[:, :, i].reshape(-1, 2).sort(-1).values == o.sort(-1).values).all(-1).sum())
                   for i, o in zip(moe, own_forced))
    ref_grads = checkpoint_state(hf, ref_grads)
    results = {"routing_reference": {
        "loss": ref_loss, "unforced_loss": unforced_loss, "moe_layers": moe, "recorded_mismatches": mismatches,
        "dense_layer_recorded": int((table[:, :, [i for i in range(table.shape[2]) if i not in moe]] >= 0).sum()),
        "expected_agreement": agreeing / (rows * seq * len(moe)), "forced_share": float(pick.sum()) / (rows * seq),
        "max_grad": max(g.abs().max().item() for g in ref_grads.values()),
        "forcing_grad_effect": max((ref_grads[k] - unforced_grads[k]).abs().max().item() for k in ref_grads)}}
    data = {**batch, "routed_experts": forced.to(torch.int16)}
    for name, (sizes, mbs) in ROUTING_CASES.items():
        loss, grads, info = megatron_case(hf, data, world, mbs, state=state, routing="replay", **sizes)
        results[name] = {"loss": loss, "agreement": info["moe/routing_agreement"],
                         "max_grad_diff": max((grads[k] - ref_grads[k]).abs().max().item() for k in grads)}
    loss, _, info = megatron_case(hf, data, world, 2, state=state, routing="compare")
    results["routing/compare_ep1"] = {"loss": loss, "agreement": info["moe/routing_agreement"]}
    return results


ROLLOUT_PROMPTS = {0: [[5, 17, 33, 101, 7, 9, 12]], 1: [[42, 9, 200], [7, 7, 81, 3, 60], [11, 150]]}


def rollout_routing_case(world: int) -> dict:
    """R3 (``algorithm.routing_replay=r3``): Qwen3-MoE at EP=2 (DP=2), fp32, sampled by the Megatron engine
    on the policy's own shards, the two ranks on different prompts (1 vs 3 prompts x 2 samples, batches of
    4 rows: 1 vs 2 engine batches, and different stopping points: the expert-parallel lockstep). Each
    sample's recorded routing is compared with HF's router choices on prompt + response, and a training
    pass replaying it (the trainer's R3 pass) with the engine's logprobs."""
    hf = tiny_qwen3_moe(seed=3)
    cfg = hf.config
    init_distributed(ParallelLayout(world_size=world, expert_model_parallel_size=2))
    model = build_gpt_model(cfg, transformer_config(cfg, expert_model_parallel_size=2))
    load_hf_weights(model, checkpoint_state(hf), get_bridge(cfg))
    ddp, _ = setup_training(model, OptimConfig())
    rank = dist.get_rank()
    engine = MegatronEngine(unwrap(ddp), None, eos_token_id=cfg.vocab_size - 1, vocab_size=cfg.vocab_size,
                            max_model_len=64, max_batch_size=4, seed=rank, record_routing=True)
    samples = [s for group in engine.generate(ROLLOUT_PROMPTS[rank], SamplingConfig(n=2, temperature=1.0, max_tokens=6))
               for s in group]
    mismatches = unknown_inside = dense_recorded = 0
    for s in samples:
        ids = s.prompt_ids + s.response_ids
        with torch.no_grad(), hf_routing(hf) as own:
            hf(torch.tensor([ids]))
        moe = [i for i in range(cfg.num_hidden_layers) if (s.routed_experts[:-1, i] >= 0).any()]
        for i, chosen in zip(moe, own):  # every position but the last (sampled, never fed back)
            mine = s.routed_experts[:-1, i].long().sort(-1).values
            mismatches += int((mine != chosen[:-1].sort(-1).values).any(-1).sum())
            unknown_inside += int((s.routed_experts[:-1, i] < 0).any(-1).sum())
        dense_recorded += int((s.routed_experts[:, [i for i in range(cfg.num_hidden_layers) if i not in moe]] >= 0).sum())
    batch = rollout_batch(samples, pad_id=0)
    routes = RoutingPass.of(ddp, REPLAY)
    # one micro-batch per rank: the ranks of an expert-parallel group must run the same number of forwards
    lp = policy_logprobs(ddp, split_microbatches(batch, len(samples)), cfg.vocab_size, 1.0, routing=routes)
    mask = batch["response_mask"].bool()
    diff = (lp - batch["rollout_logprobs"])[mask].abs()
    info = {"rank": rank, "samples": len(samples), "moe_layers": moe, "mismatches": mismatches,
            "unknown_inside": unknown_inside, "dense_recorded": dense_recorded,
            "last_unknown": all(bool((s.routed_experts[-1] < 0).all()) for s in samples),
            "lengths_ok": all(s.routed_experts.shape[0] == len(s.prompt_ids) + len(s.response_ids) for s in samples),
            "response_lengths": [len(s.response_ids) for s in samples],
            "max_logprob_diff": diff.max().item(), "prob_error": torch.exp(diff).mean().item(),
            **agreement_metrics(ddp)}
    parts = [None] * world
    dist.all_gather_object(parts, info)
    return {"rollout_routing/ep2": parts}


def main(path: str) -> None:
    _, world, _ = env_world()
    results = logit_cases(world)
    if world == 2:
        results.update(grad_cases(world))
        results.update(routing_cases(world))
        results.update(rollout_routing_case(world))
    write_results_and_shutdown(path, results)


if __name__ == "__main__":
    main(sys.argv[1])
    exit_now()
