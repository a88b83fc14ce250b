"""torchrun worker (2 processes): the dense process reward's step scores of an RL job
(:func:`alignment.trainers.process_rewarding.score_steps`, the frozen PRM as Megatron loads it)
for fixed responses, at DP=2, TP=2 and PP=2 (the pipeline's scores summed onto every stage).

    torchrun --nproc-per-node 2 tests/dist/process_reward_worker.py PRM_DIR RESPONSES.json RESULT.json

RESPONSES.json: ``{"prompt": str, "responses": [str, ...]}``; writes ``{case: {"rewards", "positions"}}``
(rank 0's; every rank's must be equal, which is checked here).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import torch.distributed as dist

from parallel.layout import ParallelLayout
from parallel.state import env_world, init_distributed
from tests.dist.report import write_results_and_shutdown, exit_now

ROOT = Path(__file__).resolve().parents[2]
CASES = {"dp2": (1, 1), "tp2": (2, 1), "pp2": (1, 2)}


def main(prm_dir: str, responses_path: str, result_path: str) -> None:
    from transformers import AutoTokenizer

    from alignment.compose import compose
    from alignment.data.chat_data import encode_prompt
    from alignment.data.samples import Sample
    from alignment.trainers.process_rewarding import score_steps
    from alignment.training.offload import DevicePlacement
    from launchers.build import load_model

    _, world, _ = env_world()
    spec = json.loads(Path(responses_path).read_text())
    tok = AutoTokenizer.from_pretrained(prm_dir)
    prompt = encode_prompt(tok, [{"role": "user", "content": spec["prompt"]}])
    samples = []
    for text in spec["responses"]:
        ids = tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]
        samples.append(Sample(prompt, ids, [0.0] * len(ids), text, True))
    results = {}
    for name, (tp, pp) in CASES.items():
        init_distributed(ParallelLayout(world_size=world, tensor_model_parallel_size=tp,
                                        pipeline_model_parallel_size=pp))
        cfg = compose("grpo", [f"parallel.tensor_model_parallel_size={tp}",
                               f"parallel.pipeline_model_parallel_size={pp}", "model.dtype=float32",
                               "trainer.micro_batch_size=2"])
        models = SimpleNamespace(tokenizer=tok, placement=DevicePlacement(enabled=False),
                                 engine=SimpleNamespace(shares_trainer_weights=False),
                                 process_reward_model=load_model(cfg, prm_dir, value_head=True))
        steps = score_steps(models, samples, cfg)
        mine = {"rewards": steps.rewards, "positions": steps.positions}
        everyone = [None] * world
        dist.all_gather_object(everyone, mine)
        assert all(e == everyone[0] for e in everyone), (name, everyone)
        results[name] = mine
    write_results_and_shutdown(result_path, results)


if __name__ == "__main__":
    main(*sys.argv[1:])
    exit_now()
