"""torchrun worker: the peak resident memory of real CPU training steps, per rank, to check
:mod:`parallel.memory` against (``tests/test_plan_layout.py``).

Run: torchrun --nproc-per-node N tests/dist/memory_worker.py TP:PP:DIST_OPT[,TP:PP:DIST_OPT...] OUT.json
(``DIST_OPT`` 0/1). For each layout in turn, each rank builds a random fp32 Llama
(:data:`CONFIG`, ~32M parameters: large enough that its memory dwarfs the allocator's noise),
runs a tiny optimizer step (1 x 16 tokens: Adam creates its state) and then one of
:data:`MICROBATCHES` micro-batches of ``MICRO_BATCH x SEQ`` tokens (SFT loss), whose peak holds
everything, and reports the rise of its peak RSS over the RSS before the model was built
(``VmHWM``, reset through ``/proc/self/clear_refs``), the exact element counts of its parameters,
gradient buffer and Adam state, the bytes autograd saves in one forward (PP=1), and the
parameters of the tiny tied-embedding model at the same layout. Then it frees everything before
the next layout. Launch with
``MALLOC_MMAP_THRESHOLD_`` set (see the test) so that freed tensors go back to the OS and RSS
follows the live tensors. Writes ``{"TP:PP:DIST_OPT": [per rank dict]}`` from rank 0.
"""

from __future__ import annotations

import gc
import sys
import time

from tests.dist.report import write_results_and_shutdown, exit_now

CONFIG = dict(vocab_size=8000, hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
              num_key_value_heads=2, head_dim=64, max_position_embeddings=1024, rms_norm_eps=1e-5,
              tie_word_embeddings=False)
MICRO_BATCH, SEQ, MICROBATCHES = 2, 256, 2


def _status(key: str) -> int:
    """A ``/proc/self/status`` memory field in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def _adam_state_numel(optimizer) -> int:
    """Elements of ``exp_avg`` + ``exp_avg_sq`` of a Megatron optimizer (fp32 weights: no master copy)."""
    n = 0
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        for state in opt.optimizer.state.values():
            n += sum(state[k].numel() for k in ("exp_avg", "exp_avg_sq") if k in state)
    return n


def _saved_activation_bytes(model, input_ids) -> int:
    """Bytes of the distinct storages autograd keeps for backward in one forward of ``model``
    (its parameters excluded): the activations :func:`parallel.memory.layer_activation_bytes` counts."""
    import torch

    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    positions = torch.arange(input_ids.shape[1]).expand_as(input_ids)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(input_ids, positions, attention_mask=None)
    out.float().sum().backward()  # frees the graph (a forward whose graph is only dropped kept the model alive)
    return sum(seen.values())


def measure(tp: int, pp: int, dist_opt: bool) -> dict:
    """Peak-RSS rise and exact state sizes of this rank for one layout; collective."""
    import torch
    import torch.distributed as dist
    from transformers import LlamaConfig

    from alignment.models.gpt import build_gpt_model, transformer_config
    from alignment.trainers.sft import SFTObjective
    from alignment.training.megatron_step import OptimConfig, forward_backward, setup_training
    from parallel.layout import ParallelLayout
    from parallel.state import env_world, init_distributed

    _, world, _ = env_world()
    init_distributed(ParallelLayout(world_size=world, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp))
    from megatron.core import parallel_state as ps

    cfg = LlamaConfig(**CONFIG)
    g = torch.Generator().manual_seed(0)
    n_rows = MICRO_BATCH * MICROBATCHES
    batch = {"input_ids": torch.randint(0, cfg.vocab_size, (n_rows, SEQ), generator=g),
             "loss_mask": torch.ones(n_rows, SEQ)}
    microbatches = [{k: v[i * MICRO_BATCH:(i + 1) * MICRO_BATCH] for k, v in batch.items()}
                    for i in range(MICROBATCHES)]
    objective = SFTObjective(cfg.vocab_size)
    normalizer = (float(batch["loss_mask"].sum()) * ps.get_data_parallel_world_size(),)
    gc.collect()
    dist.barrier()
    with open("/proc/self/clear_refs", "w") as f:  # VmHWM := VmRSS from here on
        f.write("5")
    baseline = _status("VmRSS")

    model = build_gpt_model(cfg, transformer_config(cfg, tensor_model_parallel_size=tp,
                                                    pipeline_model_parallel_size=pp))
    ddp, optimizer = setup_training(model, OptimConfig(lr=1e-4, use_distributed_optimizer=dist_opt))
    warmup = [{k: v[:1, :16] for k, v in batch.items()}]  # a tiny step: Adam creates its state
    step_s = []
    for mbs in (warmup, microbatches):
        t0 = time.time()
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        forward_backward(ddp, mbs, lambda mb, o: objective.loss(mb, o, normalizer),
                         outputs=objective.outputs, forward_only=False)
        optimizer.step()
        step_s.append(round(time.time() - t0, 2))
    peak = _status("VmHWM")
    saved = _saved_activation_bytes(model, microbatches[0]["input_ids"]) if pp == 1 else None
    from tests.dist.tiny_llama import tiny_llama_config

    tied = tiny_llama_config(tie_word_embeddings=True)  # the tied-embedding count, at this layout
    tied_params = sum(p.numel() for p in build_gpt_model(tied, transformer_config(
        tied, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)).parameters())
    return {"pp_stage": ps.get_pipeline_model_parallel_rank(), "tp_rank": ps.get_tensor_model_parallel_rank(),
            "baseline_rss": baseline, "peak_rss": peak, "peak_increase": peak - baseline,
            "params": sum(p.numel() for p in model.parameters()),
            "grad_buffer": sum(buf.grad_data.numel() for buf in ddp.buffers),
            "adam_state": _adam_state_numel(optimizer), "step_s": step_s,
            "saved_activations": saved, "tiny_tied_params": tied_params}


def main(layouts: str, path: str) -> None:
    import torch.distributed as dist

    from parallel.state import env_world

    rank, world, _ = env_world()
    results = {}
    for spec in layouts.split(","):
        tp, pp, dist_opt = (int(x) for x in spec.split(":"))
        mine = measure(tp, pp, bool(dist_opt))  # its model and optimizer are garbage once it returns
        gc.collect()
        ranks = [None] * world
        dist.all_gather_object(ranks, mine)
        results[spec] = ranks
    write_results_and_shutdown(path, results)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
    exit_now()
