"""Resharding Megatron shards into vLLM's TP layout rank to rank (parallel/reshard.py) under
torchrun: every tensor of every destination rank equals vLLM's own sharding of the HF
tensors, for TP 1/2/4 x PP 1/2 training layouts (4 processes; TP4 x PP2 with 8) and vLLM
TP 1/2/4 (and 8); only the needed slices move; staging stays within the bucket budget."""

from __future__ import annotations

import pytest

from tests.dist.reshard_worker import BUCKET, LAYOUTS, MODELS, MOE_LAYOUTS

pytestmark = pytest.mark.slow  # launches processes: the full suite only (CONTRIBUTING.md, test tiers)

LLAMAS = [m for m in MODELS if MODELS[m] is not None]


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    import json

    from tests.conftest import run_torchrun

    path = tmp_path_factory.mktemp("reshard") / "reshard.json"
    run_torchrun("reshard_worker.py", str(path), nproc=4, timeout=900)
    return json.loads(path.read_text())


def test_every_destination_tensor_equals_vllms_sharding(cases):
    # gqa: 8 heads / 4 KV heads (TP 1, 2, 4); kv2: 2 KV heads (TP 1, 2); mqa: 1 KV head (TP 1)
    expected_cases = sum(3 * len([1 for tp, _ in LAYOUTS if MODELS[m][1] % tp == 0]) for m in LLAMAS)
    assert len(cases) == expected_cases + 3 * len(MOE_LAYOUTS) == 33 + 15
    for name, c in cases.items():
        assert c["wrong"] == 0, (name, c["first_wrong"])
        model = name.split("/")[0]
        if model == "qwen3_moe":  # embed, norm, lm_head; 3 MoE layers of 9 tensors (+ router, w13, w2), 1 dense of 8
            per_rank = 3 + 3 * 9 + 8
        else:  # embed, norm, 6 per layer, lm_head if untied
            per_rank = 2 + 4 * 6 + (not MODELS[model][6])
        assert c["tensors"] == 4 * per_rank, name


def test_experts_move_from_their_expert_parallel_rank(cases):
    """Qwen3-MoE (4 experts of width 48, hidden 64, 3 MoE layers) with EP=2 on 4 ranks: each rank
    holds 2 experts per layer and receives the other 2 whole from a rank of the other EP half;
    with EP=4 each rank receives 3. Dense and attention tensors are everywhere: nothing else moves."""
    expert = 2 * 48 * 64 + 64 * 48  # fc1 [gate; up] + fc2, elements
    for ep in (2, 4):
        for vtp in (1,):
            c = cases[f"qwen3_moe/tp1_pp1_ep{ep}->vllm_tp{vtp}"]
            assert c["sent_bytes"] == c["received_bytes"] == 4 * (4 - 4 // ep) * 3 * expert * 4, (ep, c)
    # expert TP = TP = 2 with EP 2: each expert split in two, so vLLM TP 2 needs one half from a peer
    assert cases["qwen3_moe/tp2_pp1_ep2->vllm_tp2"]["sent_bytes"] > 0
    assert cases["qwen3_moe/tp2_pp1_ep2->vllm_tp2"]["wrong"] == 0


def test_equal_tp_without_pp_moves_nothing(cases):
    for name in ("gqa/tp1_pp1->vllm_tp1", "gqa/tp2_pp1->vllm_tp2", "gqa/tp4_pp1->vllm_tp4", "mqa/tp1_pp1->vllm_tp1",
                 "gqa_kv2_tied_vocab300/tp1_pp1->vllm_tp1", "gqa/tp1_pp1->vllm_tp4"):
        assert cases[name]["sent_bytes"] == 0 and not cases[name]["moves_data"], name
    # TP4 -> vLLM TP4 with whole KV groups and an aligned vocabulary: every tensor IS the local shard
    assert cases["gqa/tp4_pp1->vllm_tp4"]["peak_staged_bytes"] == 0
    # Vocabulary 300: Megatron pads to 512 (256 rows per TP rank), vLLM to 320 (160 per rank). vLLM rank 1
    # needs rows 160..255 from Megatron TP rank 0: 96 rows x 64 hidden x 4 bytes, in each of 2 DP replicas.
    c = cases["gqa_kv2_tied_vocab300/tp2_pp1->vllm_tp2"]
    assert c["sent_bytes"] == c["received_bytes"] == 2 * 96 * 64 * 4


def test_only_the_needed_slices_move(cases):
    # gqa TP2 -> vLLM TP1: each rank needs its partner's half of every TP-split tensor (2 DP replicas x
    # 2 ranks). Split elements: embedding + LM head 2 x 512 x 96; per layer qkv (8+2*4)*16 x 96,
    # o_proj 96 x 128, gate_up 128 x 96, down 96 x 64. Norms are replicated and never move.
    split = 2 * 512 * 96 + 4 * (16 * 16 * 96 + 96 * 128 + 128 * 96 + 96 * 64)
    assert cases["gqa/tp2_pp1->vllm_tp1"]["sent_bytes"] == 4 * (split // 2) * 4
    # TP2 (ranks 0,1 | 2,3 are the two replicas) -> vLLM TP4 (rank d is vLLM rank d): vLLM slices 0 and 3
    # lie in the rank's own Megatron shard; slice 1 (rank 1) comes from rank 0, slice 2 (rank 2) from
    # rank 3. So 2 ranks receive a quarter of every split tensor.
    assert cases["gqa/tp2_pp1->vllm_tp4"]["sent_bytes"] == 2 * (split // 4) * 4
    for name, c in cases.items():
        # never more than every rank receiving the whole model (the naive gather's volume)
        assert c["received_bytes"] <= 4 * c["model_bytes"], name


@pytest.mark.heavy(cheap="tests/test_reshard.py::test_every_destination_tensor_equals_vllms_sharding")
def test_tp4_pp2_on_eight_ranks(tmp_path):
    import json

    from tests.conftest import run_torchrun

    path = tmp_path / "reshard8.json"
    run_torchrun("reshard_worker.py", "4x2", "gqa", str(path), nproc=8, timeout=900)
    cases = json.loads(path.read_text())
    assert sorted(cases) == [f"gqa/tp4_pp2->vllm_tp{t}" for t in (1, 2, 4, 8)]
    for name, c in cases.items():  # vLLM TP 8 > 4 KV heads: each KV head on 2 vLLM ranks
        assert c["wrong"] == 0 and c["tensors"] == 8 * (2 + 4 * 6 + 1), (name, c["first_wrong"])
        assert c["peak_staged_bytes"] <= max(BUCKET, c["largest_single_bucket"]), name
    # TP4 PP2 -> vLLM TP4: each rank lacks exactly the other stage's 2 layers of its own TP shard (and
    # the embedding or LM head): half of its vLLM shard moves
    c = cases["gqa/tp4_pp2->vllm_tp4"]
    assert 0 < c["sent_bytes"] == c["received_bytes"] < c["model_bytes"] * 8 / 4


# heavy: 4 processes; the trainer runs no virtual stages yet (docs/limitations.md)
@pytest.mark.heavy(cheap="tests/test_reshard.py::test_every_destination_tensor_equals_vllms_sharding")
def test_virtual_pipeline_chunks(tmp_path, cases):
    """TP2 x PP2 with 2 virtual stages: each rank holds 2 one-layer chunks (rank with PP stage 0
    has layers 0 and 2, stage 1 has 1 and 3); global layer names come from Megatron's offsets."""
    import json

    from tests.conftest import run_torchrun

    path = tmp_path / "reshard_vpp.json"
    run_torchrun("reshard_worker.py", "2x2v2", "gqa", str(path), nproc=4, timeout=900)
    vpp = json.loads(path.read_text())
    assert sorted(vpp) == [f"gqa/tp2_pp2_vpp2->vllm_tp{t}" for t in (1, 2, 4)]
    for name, c in vpp.items():
        assert c["wrong"] == 0 and c["tensors"] == 4 * (2 + 4 * 6 + 1), (name, c["first_wrong"])
    # same bytes as without virtual stages: each rank still lacks the other stage's 2 layers of its
    # TP shard (now layers 1,3 or 0,2 instead of 2,3 or 0,1) and the embedding or LM head
    for t in (1, 2, 4):
        assert vpp[f"gqa/tp2_pp2_vpp2->vllm_tp{t}"]["sent_bytes"] == cases[f"gqa/tp2_pp2->vllm_tp{t}"]["sent_bytes"] > 0


def test_staging_stays_within_one_bucket(cases):
    for name, c in cases.items():
        # a bucket holds more than one tensor only while it fits the budget; one tensor alone may exceed it
        assert c["peak_staged_bytes"] <= max(BUCKET, c["largest_single_bucket"]), name
    assert cases["gqa/tp2_pp2->vllm_tp1"]["buckets"] > 10  # 16 KiB buckets: streamed, not all at once
