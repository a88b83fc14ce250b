"""A run resumed from a checkpoint (model + optimizer state + step) continues exactly
like an uninterrupted one, with the plain and the distributed optimizer; distributed-optimizer
state saved at another tensor-parallel size is refused with a message that names it."""

from __future__ import annotations


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
    assert "resume with trainer.use_distributed_optimizer=false" in r["mismatch_error"]
    assert "tensor_model_parallel_size=1 (now 2)" in r["layout_error"], r["layout_error"]
    assert "pipeline_model_parallel_size" not in r["layout_error"]  # only what differs is named
