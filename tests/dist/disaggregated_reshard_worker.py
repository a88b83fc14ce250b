"""torchrun worker: the weight sync of a disaggregated job (parallel.reshard over the stateless group).

    torchrun --nproc-per-node 4 tests/dist/disaggregated_reshard_worker.py RESULT.json

Ranks 0-1 train (``LAYOUTS``: DP 2, TP 2 or PP 2 over them), ranks 2-3 only hold engines of
vLLM TP 1 or 2 (``parallel.state.init_distributed(..., rollout_ranks=2)``). For each case the
trainers stream their shards through the plan and every tensor each rollout rank receives must
equal what vLLM's own loaders put in that vLLM TP rank's parameter from the full HF tensors.
Writes {case: {wrong, tensors, sent_bytes (per trainer), received_bytes (per rollout rank),
trainer_tensors}}.
"""

from __future__ import annotations

import json
import sys

import torch

from alignment.models.families import get_bridge
from alignment.models.gpt import build_gpt_model, transformer_config
from alignment.models.weights import load_hf_weights
from alignment.rollout.engines.weight_check import vllm_reference_shard
from parallel.layout import ParallelLayout
from parallel.reshard import Resharder
from parallel.state import init_distributed, is_rollout_rank, trainer_rollout_group
from tests.dist.reshard_worker import BUCKET, hf_model
from tests.dist.tiny_models import checkpoint_state
from tests.dist.report import exit_now

TRAINERS, ENGINE_RANKS = 2, 2
LAYOUTS = [(1, 1), (2, 1), (1, 2)]  # (TP, PP) over the 2 trainers


def main(path: str) -> None:
    hf = hf_model("gqa")
    bridge, state = get_bridge(hf.config), checkpoint_state(hf)
    results = {}
    for tp, pp in LAYOUTS:
        sizes = dict(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
        init_distributed(ParallelLayout(world_size=TRAINERS, **sizes), rollout_ranks=ENGINE_RANKS)
        group = trainer_rollout_group()
        model = None
        if not is_rollout_rank():
            model = build_gpt_model(hf.config, transformer_config(hf.config, **sizes))
            load_hf_weights(model, state, bridge)
        for vtp in (1, 2):
            resharder = Resharder(model, bridge.vllm_layout(tp, vtp), vllm_tp=vtp, bucket_bytes=BUCKET, group=group,
                                  dtype=torch.float32)
            wrong, count = [], 0
            for bucket in resharder.buckets():
                for name, tensor in bucket:
                    want = vllm_reference_shard(bridge, state, name, vtp, (group.rank - TRAINERS) % vtp)
                    count += 1
                    if tensor.shape != want.shape or not torch.equal(tensor, want):
                        wrong.append(name)
            st = resharder.stats
            mine = {"rank": group.rank, "wrong": wrong[:3], "n_wrong": len(wrong), "tensors": count,
                    "sent": st.sent_bytes, "received": st.received_bytes}
            every = group.all_gather_object(mine)
            trainers, engines = every[:TRAINERS], every[TRAINERS:]
            results[f"tp{tp}_pp{pp}->vllm_tp{vtp}"] = {
                "wrong": sum(e["n_wrong"] for e in every), "first_wrong": [w for e in every for w in e["wrong"]][:3],
                "tensors": [e["tensors"] for e in engines], "trainer_tensors": sum(e["tensors"] for e in trainers),
                "sent_bytes": [e["sent"] for e in trainers], "received_bytes": [e["received"] for e in engines],
                "engines_sent": sum(e["sent"] for e in engines),
                "model_bytes": 4 * sum(v.numel() for v in state.values()),
            }
    if group.rank == 0:
        with open(path, "w") as f:
            json.dump(results, f, indent=1)
    group.barrier()


if __name__ == "__main__":
    main(sys.argv[1])
    exit_now()
