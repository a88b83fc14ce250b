"""Training health by hand: the streak of steps with skipped updates, when it stops a run, and the
message it stops with (the NaN guard itself runs in test_resume.py, on two ranks and both
optimizers, and end to end in test_offline_e2e.py)."""

from __future__ import annotations

from alignment.training.health import BadStepStreak, TrainingDiverged


def test_streak_counts_consecutive_bad_steps_only():
    s = BadStepStreak(3)
    assert [s.update(k, skipped) for k, skipped in enumerate([1, 2, 0, 1, 1], 1)] == [False] * 5
    assert (s.streak, s.first) == (2, 4)  # step 3 applied every update: the streak restarted at 4
    assert s.update(6, 1.0)  # the third consecutive bad step stops the run
    e = s.error("out/checkpoints/step_6")
    assert isinstance(e, TrainingDiverged)
    assert str(e).startswith("steps 4-6: 3 consecutive steps had NaN/inf gradients")
    assert "saved in out/checkpoints/step_6" in str(e) and "trainer.max_bad_steps=3" in str(e)


def test_zero_never_stops():
    s = BadStepStreak(0)
    assert not any(s.update(k, 1.0) for k in range(1, 50)) and s.streak == 49


def test_bounds_warn_and_stop_by_hand():
    from types import SimpleNamespace as NS

    import pytest

    from alignment.training.health import HealthMonitor, TrainingStopped, crossed_bounds

    bounds = [NS(metric="entropy", below=0.05, above=None), NS(metric="kl", below=None, above=1.0)]
    assert crossed_bounds({"entropy": 0.5, "kl": 0.1}, bounds, "stop_on") == []
    assert crossed_bounds({"entropy": 0.01, "kl": 2.0}, bounds, "stop_on") == [
        "entropy = 0.01 is below 0.05 (trainer.stop_on)", "kl = 2 is above 1 (trainer.stop_on)"]
    assert len(crossed_bounds({"entropy": float("nan"), "kl": 0.1}, bounds, "warn_on")) == 1  # NaN crosses
    with pytest.raises(KeyError, match="names the metric 'entropy', which this job does not log; it logs: kl, loss"):
        crossed_bounds({"kl": 0.0, "loss": 1.0}, bounds, "warn_on")
    trainer = NS(max_bad_steps=2, warn_on=[bounds[1]], stop_on=[bounds[0]])
    h = HealthMonitor(trainer, rank=0)
    m = {"entropy": 0.5, "kl": 3.0}
    assert not h.check(1, m) and m["health/warnings"] == 1.0  # kl warned, counted
    m = {"entropy": 0.01, "kl": 0.5}
    assert h.check(2, m) and m["health/warnings"] == 1.0
    e = h.error("ckpt/step_2")
    assert isinstance(e, TrainingStopped) and str(e).startswith("step 2: entropy = 0.01 is below 0.05")
    h = HealthMonitor(NS(max_bad_steps=2, warn_on=[], stop_on=[]), rank=0)
    assert not h.check(1, {"health/skipped_updates": 1.0}) and h.check(2, {"health/skipped_updates": 2.0})
    assert "steps 1-2: 2 consecutive steps" in str(h.error("ckpt/step_2"))
