"""torchrun worker (2 processes): SFT, reward-model, DPO and process-reward-model gradients through Megatron equal
plain autograd on the HF model over the whole batch, for DP=2 (micro-batches of 1 and 2
examples), TP=2, TP=2 + sequence parallelism and PP=2.

Also checks the reward model's forward against HF ``LlamaForSequenceClassification``
(its own pooling at the last non-pad token) for every layout.
Writes {objective: {case: {"loss", "max_grad_diff"}, "reference_loss", "reference_max_grad"}}.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from transformers import LlamaForSequenceClassification

from alignment.models.families import get_bridge
from alignment.models.gpt import build_gpt_model, transformer_config
from alignment.models.value_head import build_value_model
from alignment.models.weights import export_hf_weights, load_hf_weights
from alignment.trainers import offline
from alignment.trainers.dpo import DPOObjective
from alignment.trainers.process_reward import ProcessRewardObjective
from alignment.trainers.reward_model import RewardModelObjective
from alignment.trainers.sft import SFTObjective
from alignment.training.batching import make_sequence_batch, split_microbatches
from alignment.training.megatron_step import OptimConfig, global_sums, setup_training, value_outputs
from parallel.layout import ParallelLayout
from parallel.state import env_world, init_distributed
from tests.dist.report import write_results_and_shutdown, exit_now
from tests.dist.tiny_llama import tiny_llama, tiny_llama_config

PAD = 0
# (tp, pp, sp, examples per micro-batch, context_parallel_size, cp_comm_type, sequence packing)
CASES = {"dp2_mbs1": (1, 1, False, 1, 1, "p2p", False), "dp2_mbs2": (1, 1, False, 2, 1, "p2p", False),
         "tp2": (2, 1, False, 2, 1, "p2p", False), "tp2_sp": (2, 1, True, 1, 1, "p2p", False),
         "pp2": (1, 2, False, 1, 1, "p2p", False), "dp2_packed": (1, 1, False, 2, 1, "p2p", True),
         "cp2_ring_packed": (1, 1, False, 2, 2, "p2p", True), "cp2_ulysses": (1, 1, False, 1, 2, "a2a", False)}


def rows(vocab: int, n: int):
    """``n`` (ids, prompt_len) rows of uneven lengths, no PAD token inside."""
    g = torch.Generator().manual_seed(11)
    out = []
    for i in range(n):
        length = 7 + (i * 5) % 9
        ids = torch.randint(1, vocab, (length,), generator=g).tolist()
        out.append((ids, 2 + i % 4))
    return out


def step_targets(batch):
    """PRM step labels: every row's response split into steps ending at every third response token
    and at its last one, labelled 1, 0, 1, ... by row and step."""
    from alignment.algorithms.prm_loss import place_step_labels

    ends, labels = [], []
    for i, (n, r) in enumerate(zip(batch["seq_lengths"].tolist(), batch["response_lengths"].tolist())):
        row = sorted(set(range(n - r + 2, n, 3)) | {n - 1})
        ends.append(row)
        labels.append([(i + k) % 2 for k in range(len(row))])
    return place_step_labels(ends, labels, batch["input_ids"].shape[1])


def hf_models(seed=3):
    lm = tiny_llama(seed=seed, tie_word_embeddings=False)
    cfg = tiny_llama_config(tie_word_embeddings=False)
    cfg.num_labels, cfg.pad_token_id = 1, PAD
    rm = LlamaForSequenceClassification(cfg).float().eval()
    state = {k: v for k, v in lm.state_dict().items() if k.startswith("model.")}
    state["score.weight"] = 0.3 * torch.randn(1, cfg.hidden_size, generator=torch.Generator().manual_seed(9))
    rm.load_state_dict(state)
    return lm, rm


def hf_logps(lm, batch):
    logits = lm(batch["input_ids"]).logits.float()
    lp = torch.log_softmax(logits, -1)[:, :-1].gather(-1, batch["input_ids"][:, 1:, None])[..., 0]
    return torch.cat([lp, lp.new_zeros(lp.shape[0], 1)], 1)


def reference(kind, lm, rm, batch):
    """Loss of the whole batch and HF-named gradients by plain autograd in one process."""
    model = rm if kind in ("rm", "prm") else lm
    model.zero_grad()
    obj = objective(kind, lm.config.vocab_size)
    if kind in ("rm", "prm"):
        values = rm.score(rm.model(batch["input_ids"]).last_hidden_state)  # [N, seq, 1]
        loss, _ = obj.loss(batch, {"values": values.squeeze(-1)}, obj.normalizer(batch))
    else:
        logps = hf_logps(lm, batch)
        loss = reference_loss(kind, obj, batch, logps)
    loss.backward()
    return loss.item(), {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}


def reference_loss(kind, obj, batch, logps):
    """The objective's loss written out on HF log-probs (independent of Megatron)."""
    mask = batch["loss_mask"]
    if kind == "sft":
        return -(logps * mask).sum() / mask.sum()
    seq = (logps * mask).sum(1)
    h = (seq[0::2] - batch["ref_logps"][0::2]) - (seq[1::2] - batch["ref_logps"][1::2])
    return -torch.nn.functional.logsigmoid(obj.beta * h).mean()  # DPO eq. 7, mean over pairs


def objective(kind, vocab):
    return {"sft": lambda: SFTObjective(vocab), "rm": lambda: RewardModelObjective(),
            "dpo": lambda: DPOObjective(vocab, beta=0.5), "prm": lambda: ProcessRewardObjective()}[kind]()


def megatron_case(kind, lm, rm, batch, tp, pp, sp, mbs, cp, comm, packed, world, state=None, lora=None,
                  adapters=None):
    """Loss, HF-named gradients (``lora``: the adapters', PEFT-named, starting from ``adapters``),
    the reward model's scores, and this rank's slice of the batch; weights from ``state`` (HF
    checkpoint form, default the HF model's)."""
    from megatron.core import parallel_state as ps

    init_distributed(ParallelLayout(world_size=world, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                    sequence_parallel=sp, context_parallel_size=cp, cp_comm_type=comm))
    cfg = lm.config
    tcfg = transformer_config(cfg, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, sequence_parallel=sp,
                              context_parallel_size=cp, cp_comm_type=comm)
    if kind in ("rm", "prm"):
        model, bridge, hf = build_value_model(cfg, tcfg), get_bridge(cfg, head="score"), rm
    else:
        model, bridge, hf = build_gpt_model(cfg, tcfg), get_bridge(cfg), lm
    load_hf_weights(model, hf.state_dict() if state is None else state, bridge)
    if lora is not None:
        from alignment.models.lora_export import load_lora_adapters
        from parallel.lora import apply_lora

        apply_lora(model, lora)
        load_lora_adapters(model, bridge, adapters)
    ddp, _ = setup_training(model, OptimConfig())
    obj = objective(kind, cfg.vocab_size)
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    n = batch["input_ids"].shape[0] // dp
    local = {k: v[dp_rank * n : (dp_rank + 1) * n] for k, v in batch.items()}
    scores = None
    if kind == "rm":  # forward parity with HF's own sequence-classification pooling
        out = offline.forward_backward(ddp, [local], lambda mb, o: (o["values"].sum() * 0, {"v": o["values"]}),
                                       outputs=value_outputs, forward_only=True, packing=packed)
        if out:
            from alignment.models.value_head import sequence_scores

            scores = sequence_scores(out[0]["v"], local["last_index"])
    ddp.zero_grad_buffer()
    normalizer = tuple(offline.all_reduce_sum(list(obj.normalizer(local)), ps.get_data_parallel_group()))
    out = offline.forward_backward(ddp, split_microbatches(local, mbs * obj.rows_per_example),
                                   lambda mb, o: obj.loss(mb, o, normalizer), outputs=obj.outputs, forward_only=False,
                                   packing=packed)
    sums = global_sums(out)
    loss = (sums.get("loss_sum", sums.get("nll_sum")) / (sums["count"]))
    if lora is not None:
        from alignment.models.lora_export import export_lora_adapters

        grads = export_lora_adapters(ddp, bridge, source=lambda p: p.main_grad)
    else:
        grads = export_hf_weights(ddp, bridge, source=lambda p: p.main_grad)
    return loss, grads, scores, dp_rank, n


def main(path: str) -> None:
    rank, world, _ = env_world()
    lm, rm = hf_models()
    batch = make_sequence_batch(rows(lm.config.vocab_size, 8), PAD)
    with torch.no_grad():  # a reference near the policy, so the DPO loss is near log 2, not saturated
        seq = (hf_logps(lm, batch) * batch["loss_mask"]).sum(1)
    batch["ref_logps"] = seq + 0.5 * torch.randn(8, generator=torch.Generator().manual_seed(4))
    batch["step_labels"], batch["step_mask"] = step_targets(batch)
    with torch.no_grad():
        hf_scores = rm(batch["input_ids"]).logits[:, 0]  # HF pools at the last non-pad token
    results = {}
    for kind in ("sft", "rm", "dpo", "prm"):
        ref_loss, ref_grads = reference(kind, lm, rm, batch)
        res = {"reference_loss": ref_loss, "reference_max_grad": max(g.abs().max().item() for g in ref_grads.values())}
        for name, case in CASES.items():
            loss, grads, scores, dp_rank, n = megatron_case(kind, lm, rm, batch, *case, world)
            assert set(grads) == set(ref_grads), sorted(set(ref_grads) ^ set(grads))
            res[name] = {"loss": loss, "max_grad_diff": max((grads[k] - ref_grads[k]).abs().max().item() for k in grads)}
            if kind == "rm":
                diff = torch.zeros(())
                if scores is not None:
                    diff = (scores - hf_scores[dp_rank * n : (dp_rank + 1) * n]).abs().max()
                dist.all_reduce(diff, op=dist.ReduceOp.MAX)
                res[name]["max_score_diff"] = diff.item()
        results[kind] = res
    results["hf_score_std"] = hf_scores.std().item()
    write_results_and_shutdown(path, results)


if __name__ == "__main__":
    main(sys.argv[1])
    exit_now()
