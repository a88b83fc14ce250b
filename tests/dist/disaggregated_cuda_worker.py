"""torchrun worker (2 processes, CUDA): a disaggregated job's weight sync from a trainer whose
model lives on the GPU to an engine rank that receives into GPU buffers, over the stateless gloo
group (CUDA tensors staged through host memory both ways).

    torchrun --nproc-per-node 2 tests/dist/disaggregated_cuda_worker.py DTYPE RESULT.json

Without CUDA it runs the same steps on the CPU (no staging): a dry run of the worker itself.

Rank 0 trains (TP 1, PP 1), rank 1 is the engine rank of a vLLM TP 1 engine. On a machine with
a single GPU both use device 0: each default group is a world of one (NCCL) and the bridge
between them is gloo, so no NCCL communicator ever spans the shared device. Writes {wrong,
first_wrong, tensors, devices, dtypes, sent_bytes, received_bytes, model_bytes}.
"""

from __future__ import annotations

import json
import os
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


def main(dtype_name: str, path: str) -> None:
    dtype = getattr(torch, dtype_name)
    kind = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: the same path without staging (a dry run)
    if kind == "cuda" and torch.cuda.device_count() < 2:  # one GPU: both processes on device 0 (module docstring)
        os.environ["LOCAL_RANK"] = "0"
    hf = hf_model("gqa")
    bridge, state = get_bridge(hf.config), checkpoint_state(hf)
    init_distributed(ParallelLayout(world_size=1), rollout_ranks=1)
    group, model = trainer_rollout_group(), None
    if not is_rollout_rank():
        model = build_gpt_model(hf.config, transformer_config(hf.config, params_dtype=dtype))
        load_hf_weights(model, state, bridge)
        assert {p.device.type for p in model.parameters()} == {kind}, f"the trainer's model is not on {kind}"
    device = torch.device("cuda", torch.cuda.current_device()) if kind == "cuda" else torch.device("cpu")
    resharder = Resharder(model, bridge.vllm_layout(1, 1), vllm_tp=1, bucket_bytes=BUCKET, group=group,
                          dtype=dtype, device=device)
    wrong, count, devices, dtypes = [], 0, set(), set()
    for bucket in resharder.buckets():
        for name, tensor in bucket:
            count += 1
            devices.add(tensor.device.type)
            dtypes.add(str(tensor.dtype))
            want = vllm_reference_shard(bridge, state, name, 1, 0).to(dtype)
            if tensor.shape != want.shape or not torch.equal(tensor.cpu(), want):
                wrong.append(name)
    st = resharder.stats
    every = group.all_gather_object({"wrong": wrong, "tensors": count, "devices": sorted(devices),
                                     "dtypes": sorted(dtypes), "sent": st.sent_bytes, "received": st.received_bytes})
    if group.rank == 0:
        trainer, engine = every
        with open(path, "w") as f:
            json.dump({"wrong": len(trainer["wrong"]) + len(engine["wrong"]), "first_wrong": engine["wrong"][:3],
                       "tensors": engine["tensors"], "devices": engine["devices"], "dtypes": engine["dtypes"],
                       "sent_bytes": trainer["sent"], "received_bytes": engine["received"],
                       "model_bytes": torch.tensor([], dtype=dtype).element_size()
                       * sum(v.numel() for v in state.values())}, f, indent=1)
    group.barrier()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
    exit_now()
