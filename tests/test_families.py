"""Qwen3 and Qwen3-MoE on Megatron-Core equal transformers (tests/dist/family_worker.py): logits
for TP / PP / EP / expert-TP layouts, exact HF export, and Qwen3-MoE GRPO gradients (with and
without the load-balancing loss) equal to single-process autograd on the HF model; plus the
family tables and the MoE layout validation, without processes."""

from __future__ import annotations

import pytest

from tests.dist.family_worker import GRAD_CASES, LOGIT_CASES, ROUTING_CASES


def check_logits(results: dict, cases: dict) -> None:
    assert set(cases) <= set(results)
    for name in cases:
        r = results[name]
        assert r["ref_logit_std"] > 0.5, name  # logits far from zero: the comparison has teeth
        assert r["max_abs_diff"] <= 1e-4, (name, r)
        assert r["export_max_abs_diff"] == 0.0 and r["export_missing"] == [], (name, r)


@pytest.mark.slow
def test_two_rank_layouts_and_gradients(torchrun_json):
    r = torchrun_json("family_worker.py", nproc=2)
    check_logits(r, LOGIT_CASES[2])
    ref = r["grad_reference"]
    assert ref["max_grad"] > 1e-2 and ref["aux_loss"] > 0.9  # switch loss >= 1, = 1 when balanced
    for name in GRAD_CASES:
        c = r[name]
        assert abs(c["loss"] - c["reference_loss"]) <= 1e-5 * max(1.0, abs(c["reference_loss"])), (name, c)
        assert c["max_grad_diff"] <= 1e-5 * ref["max_grad"] + 1e-7, (name, c)
        # routing statistics of the training pass = counts from HF's own router logits
        assert abs(c["moe/load_imbalance"] - ref["load_imbalance"]) <= 1e-5, (name, c)
        assert abs(c["moe/load_imbalance_max"] - ref["load_imbalance_max"]) <= 1e-5, (name, c)
    for name in ("grad_aux/ep1", "grad_aux/ep2"):
        assert abs(r[name]["moe/aux_loss"] - ref["aux_loss"]) <= 1e-5, r[name]
    assert "moe/aux_loss" not in r["grad/ep2"]  # coefficient 0: Megatron does not compute it
    # the load-balancing term really moves the router gradient, and Megatron matches it
    assert ref["aux_router_grad_effect"] > 100 * max(r[n]["max_router_grad_diff"] for n in GRAD_CASES)
    check_routing_replay(r)
    check_rollout_routing(r["rollout_routing/ep2"])


def check_rollout_routing(ranks: list[dict]) -> None:
    """R3 at EP=2: the Megatron engine generated on both ranks together (1 vs 2 batches, other prompt
    lengths), and every sample's recorded routing is HF's router choice at every position and MoE layer
    (nothing missing but the last, never-fed-back token; nothing in the dense layer); a training pass
    replaying it gives the engine's logprobs (fp32 token_mult_prob_error 1) with agreement 1."""
    assert [c["samples"] for c in ranks] == [2, 6], ranks
    for c in ranks:
        assert c["moe_layers"] == [0, 1, 2] and c["lengths_ok"] and c["last_unknown"], c
        assert c["mismatches"] == 0 and c["unknown_inside"] == 0 and c["dense_recorded"] == 0, c
        assert c["max_logprob_diff"] < 1e-5 and c["prob_error"] < 1 + 1e-5, c
        assert c["moe/routing_agreement"] == 1.0, c


def check_routing_replay(r: dict) -> None:
    """MoE routing replay (alignment/training/routing_replay.py): what Megatron records is HF's routing,
    token for token; a forced table replayed at EP=1, EP=2, TP=2 with sequence parallelism and PP=2 gives
    the loss and gradients of the HF model forced to the same experts, and the agreement each logs is the
    share of (token, layer) pairs whose own choice (given the forced layers before) is the table's."""
    ref = r["routing_reference"]
    assert ref["moe_layers"] == [0, 1, 2] and ref["dense_layer_recorded"] == 0  # layer 3 is a dense MLP
    assert ref["recorded_mismatches"] == 0
    # the forced experts change the model: the loss, and the gradients by far more than the tolerance
    assert abs(ref["loss"] - ref["unforced_loss"]) > 1e-4 and ref["forcing_grad_effect"] > 1e-2 * ref["max_grad"], ref
    # a third of the tokens forced in each layer (and the later layers' own choices moved by it)
    assert abs(ref["forced_share"] - 1 / 3) < 0.02 and 0.3 < ref["expected_agreement"] < 0.67, ref
    for name in ROUTING_CASES:
        c = r[name]
        assert abs(c["loss"] - ref["loss"]) <= 1e-5 * max(1.0, abs(ref["loss"])), (name, c, ref)
        assert c["max_grad_diff"] <= 1e-5 * ref["max_grad"] + 1e-7, (name, c, ref)
        assert c["agreement"] == pytest.approx(ref["expected_agreement"], abs=1e-9), (name, c)
    # compare: the model keeps its own experts (the unforced loss), which differ from the table exactly
    # where the table was forced
    c = r["routing/compare_ep1"]
    assert abs(c["loss"] - ref["unforced_loss"]) <= 1e-5 * max(1.0, abs(ref["unforced_loss"])), (c, ref)
    assert c["agreement"] == pytest.approx(1.0 - ref["forced_share"], abs=1e-9), c


# heavy: 4 processes on 2 cores; the 2-rank layouts run in CI
@pytest.mark.heavy(cheap="tests/test_families.py::test_two_rank_layouts_and_gradients")
@pytest.mark.slow
def test_expert_and_tensor_parallel_layouts_on_four_ranks(torchrun_json):
    check_logits(torchrun_json("family_worker.py", nproc=4), LOGIT_CASES[4])


def test_tables_map_every_hf_tensor_once():
    """Every tensor of an HF checkpoint of each family is made by exactly one Megatron parameter
    (a tied LM head by none), and round-trips through TP shards exactly."""
    import torch

    from alignment.models.families import get_bridge
    from tests.dist.tiny_models import checkpoint_state, tiny_qwen3, tiny_qwen3_moe

    for hf in (tiny_qwen3(seed=0), tiny_qwen3(seed=0, tie_word_embeddings=True), tiny_qwen3_moe(seed=0)):
        state, bridge = checkpoint_state(hf), get_bridge(hf.config)
        made = [n for mg in bridge.megatron_names() for n in bridge.hf_names(mg)]
        assert sorted(made) == sorted(set(state) - ({"lm_head.weight"} if hf.config.tie_word_embeddings else set()))
        for mg in bridge.megatron_names():
            back = bridge.to_hf(mg, [bridge.to_megatron_shard(mg, state, j, 2) for j in range(2)])
            assert all(torch.equal(back[k], state[k]) for k in back), mg


def test_qwen3_moe_dims_and_layer_pattern():
    from alignment.models.families import model_dims
    from tests.dist.tiny_models import tiny_qwen3_moe_config

    d = model_dims(tiny_qwen3_moe_config())
    assert (d.num_experts, d.moe_ffn_hidden_size, d.moe_router_topk, d.moe_norm_topk_prob) == (4, 48, 2, True)
    assert d.moe_layer_pattern == (1, 1, 1, 0) and d.qk_layernorm and not d.qkv_bias
    cfg = tiny_qwen3_moe_config(mlp_only_layers=())
    cfg.decoder_sparse_step = 2  # HF: layer i is sparse when (i + 1) % step == 0
    assert model_dims(cfg).moe_layer_pattern == (0, 1, 0, 1)


def test_moe_layouts_are_validated_before_any_process_group():
    from alignment.models.families import model_dims
    from parallel.layout import LayoutError, ParallelLayout, validate_model_layout
    from tests.dist.tiny_models import tiny_qwen3_config, tiny_qwen3_moe_config

    moe, dense = model_dims(tiny_qwen3_moe_config()), model_dims(tiny_qwen3_config())  # 4 experts of width 48
    validate_model_layout(ParallelLayout(world_size=4, expert_model_parallel_size=4), moe)
    validate_model_layout(ParallelLayout(world_size=2, tensor_model_parallel_size=2, sequence_parallel=True,
                                         expert_model_parallel_size=2, expert_tensor_parallel_size=1), moe)
    with pytest.raises(LayoutError, match=r"expert_model_parallel_size=3 must divide the model's 4 experts; "
                                          r"valid values with world size 6: \[1, 2\]"):
        validate_model_layout(ParallelLayout(world_size=6, expert_model_parallel_size=3), moe)
    with pytest.raises(LayoutError, match=r"2 x 2 x 1 \(Megatron's expert grid\)"):
        validate_model_layout(ParallelLayout(world_size=2, tensor_model_parallel_size=2, sequence_parallel=True,
                                             expert_model_parallel_size=2), moe)
    with pytest.raises(LayoutError, match="parallel.sequence_parallel=true"):
        validate_model_layout(ParallelLayout(world_size=2, tensor_model_parallel_size=2), moe)
    with pytest.raises(LayoutError, match="expert_tensor_parallel_size=5 must divide the expert MLP size 48"):
        validate_model_layout(ParallelLayout(world_size=5, expert_tensor_parallel_size=5), moe)
    with pytest.raises(LayoutError, match="this model has no experts"):
        validate_model_layout(ParallelLayout(world_size=2, expert_model_parallel_size=2), dense)


def test_parallel_knows_no_model():
    """``parallel/`` is model-agnostic: no module there imports from ``alignment`` (a family's layout
    reaches the resharder as a target-layout callable)."""
    import ast

    from tests.conftest import ROOT

    for path in sorted((ROOT / "parallel").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            assert not any(n.split(".")[0] == "alignment" for n in names), (path.name, names)
