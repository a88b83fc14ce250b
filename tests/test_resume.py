"""A run resumed from a checkpoint (model + optimizer state + step) continues exactly
like an uninterrupted one, with the plain and the distributed optimizer; distributed-optimizer
state saved at another tensor-parallel size is refused with a message that names it, and resumes
there once rewritten fully reshardable (``trainer.reshard_checkpoint``), at another TP, PP or EP size."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow  # launches processes: the full suite only (CONTRIBUTING.md, test tiers)


def test_resumed_training_equals_uninterrupted_and_nan_updates_are_skipped(torchrun_json, tmp_path):
    r = torchrun_json("resume_worker.py", str(tmp_path / "ckpt"))
    for name in ("optimizer", "distributed_optimizer"):
        assert r[name]["step"] == 2
        assert r[name]["resumed_vs_straight"] <= 1e-6, r  # measured 0.0
        # control: restoring the model without the Adam state does change the result
        assert r[name]["model_only_vs_straight"] > 1e-3, r
        # a NaN gradient on rank 1 only: the update is skipped on both ranks, the weights do not move, and the
        # same step taken cleanly afterwards lands exactly where the uninterrupted run did (Adam's moments and
        # step count untouched by the skipped update)
        assert r[name]["poisoned_applied"] == [False] and r[name]["poisoned_moved"] == 0.0, r
        assert r[name]["after_skip_vs_straight"] <= 1e-6, r
        # saved before any update was applied (Adam's state still empty), resumed: the uninterrupted run's steps
        assert r[name]["before_first_update_vs_straight"] <= 1e-6, r
    assert "resume with trainer.use_distributed_optimizer=false" in r["mismatch_error"]
    # every file of a checkpoint is in its manifest; a shard cut short is named before anything is read
    assert {"common.pt", "metadata.json", ".metadata"} <= set(r["manifest_files"]), r["manifest_files"]
    assert any(f.endswith(".distcp") for f in r["manifest_files"])
    assert "is damaged: __" in r["damaged_error"] and "were written" in r["damaged_error"], r["damaged_error"]
    assert "tensor_model_parallel_size=1 (now 2)" in r["layout_error"], r["layout_error"]
    assert "pipeline_model_parallel_size" not in r["layout_error"]  # only what differs is named
    assert "trainer.reshard_checkpoint=true" in r["layout_error"]
    # rewritten fully reshardable, the DP=2 state resumes at TP=2 and at PP=2 (DP=1), and a tiny Qwen3-MoE's
    # with its experts shared out (EP=2, their own optimizer) and back (EP 2 -> 1): the same weights after the
    # next step as the run that never changed layout, within fp32 reduction-order noise; without its Adam
    # state (control) far from them
    for layout in ("tp2", "pp2", "ep2", "ep1"):
        got = r[f"resharded_{layout}"]
        assert got["step"] == 2 and got["resumed_vs_straight"] <= 1e-5, (layout, got)
        assert got["model_only_vs_straight"] > 1e-3, (layout, got)
    # trainer.grad_stats_every: per layer group, the squares add up to the optimizer's own (pre-clip) gradient
    # norm, and the groups are the same whether the gradients are whole (plain optimizer), DP shards
    # (distributed optimizer) or TP shards with duplicated norms (TP=2)
    reference = r["grad_stats_optimizer"]
    expected = {"grad_norm/embedding", "grad_norm/final_norm", "grad_norm/output_layer",
                *(f"grad_norm/layer_{i:02d}/{part}" for i in range(4) for part in ("attention", "mlp"))}
    for layout in ("optimizer", "distributed_optimizer", "tp2_optimizer", "tp2_distributed_optimizer"):
        stats = r[f"grad_stats_{layout}"]
        assert len(stats) == 3, layout
        for (groups, norm), (ref_groups, _) in zip(stats, reference):
            assert set(groups) == expected, (layout, sorted(groups))
            assert sum(v * v for v in groups.values()) ** 0.5 == pytest.approx(norm, rel=1e-5), (layout, groups, norm)
            assert min(groups.values()) > 0, (layout, groups)
            for k, v in groups.items():
                assert v == pytest.approx(ref_groups[k], rel=1e-4, abs=1e-7), (layout, k, v, ref_groups[k])
