"""One process of tests/test_compile_cache.py: compile a stand-in of a model dir's shape under its compile cache.

    python tests/dist/compile_cache_worker.py MODEL_DIR

With ``$MEGALIGN_CACHE`` set by the test: activates :func:`alignment.rollout.engines.compile_cache.compile_cache` for
MODEL_DIR (as a compiled vLLM engine does), ``torch.compile``s a SwiGLU block of the config's hidden and
intermediate sizes with Inductor, runs it, marks the cache complete when it was cold, and prints one JSON line:
the key, whether the cache was warm, and Inductor's FX-graph cache hits and misses.
"""

from __future__ import annotations

import json
import sys
import time

import torch
import torch.nn.functional as F

from alignment.rollout.engines.compile_cache import compile_cache


def main(model_dir: str) -> None:
    config = json.loads(open(f"{model_dir}/config.json").read())
    cache = compile_cache(model_dir, dtype="float32", max_model_len=64)
    warm = cache.warm
    cache.activate()
    h, inter = config["hidden_size"], config["intermediate_size"]
    torch.manual_seed(0)
    up, gate, down = torch.randn(inter, h), torch.randn(inter, h), torch.randn(h, inter)

    def block(x):
        return F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), down)

    t0 = time.perf_counter()
    with torch.no_grad():
        torch.compile(block, backend="inductor")(torch.randn(4, h))
    seconds = time.perf_counter() - t0
    if not warm:
        cache.mark_complete(seconds)
    from torch._dynamo.utils import counters

    print(json.dumps({"key": cache.key, "warm": warm, "hit": counters["inductor"]["fxgraph_cache_hit"],
                      "miss": counters["inductor"]["fxgraph_cache_miss"], "seconds": seconds,
                      "inductor_dir": str(cache.path / "inductor")}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
