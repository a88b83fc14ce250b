"""Experiment trackers beside TensorBoard (``logger.backends``, launchers/trackers.py): a real 2-rank GRPO job logs to
W&B (offline), MLflow (a local SQLite store) and Trackio (its local store), stops at step 2 and resumes to step 4;
each backend's stored scalars equal TensorBoard's at every step, the resumed job continues the same run, and the
config is the run's parameters. A tracker that cannot start is one line (or left out with ``on_error=warn``)."""

from __future__ import annotations

import socket

import numpy as np
import pytest

from alignment.config import LoggerConfig
from launchers import trackers
from tests.conftest import Job, run_jobs
from tests.dist.tiny_llama import save_tiny_hf_dir
from tests.tracker_stores import mlflow_runs, trackio_runs, wandb_offline
from tools.plot_metrics import read_scalars


def test_config_as_parameters_is_flat_text():
    assert trackers.flat_params({"a": {"b": 1, "c": {"d": [1, 2]}}, "e": None, "f": "x"}) == {
        "a.b": "1", "a.c.d": "[1, 2]", "e": "None", "f": "x"}


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # nothing listens once it is closed


def test_a_tracker_that_cannot_start_is_one_line_or_left_out(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{_closed_port()}")
    with pytest.raises(trackers.TrackerError, match=r"^logger.backends: mlflow did not start: TrackerError: "
                                                    r"MLFLOW_TRACKING_URI=http://127.0.0.1:\d+ does not answer"):
        trackers.start(LoggerConfig(backends=["tensorboard", "mlflow"]), "run", {}, tmp_path, None)
    started = trackers.start(LoggerConfig(backends=["mlflow"], on_error="warn"), "run", {}, tmp_path, None)
    assert started == [] and "going on without it (logger.on_error=warn)" in capsys.readouterr().out


def test_mlflow_names_and_the_run_ids_a_checkpoint_keeps(tmp_path):
    assert trackers.mlflow_name("heldout/pass@4") == "heldout/pass_at_4"
    assert trackers.mlflow_name("reward/mean") == "reward/mean" and trackers.mlflow_name("a#b") == "a_b"
    assert trackers.saved_ids(None) == {} and trackers.saved_ids(tmp_path) == {}
    (tmp_path / "critic").mkdir()  # a checkpoint of several models (PPO): the files are in each part's folder
    (tmp_path / "critic" / trackers.IDS_FILE).write_text('{"wandb": "abc"}')
    assert trackers.saved_ids(tmp_path) == {"wandb": "abc"}
    (tmp_path / trackers.IDS_FILE).write_text('{"mlflow": "def"}')
    assert trackers.saved_ids(tmp_path) == {"mlflow": "def"}


class Failing:
    name, run_id = "failing", "x"

    def log(self, values, step):
        raise OSError("disk full")


def test_a_tracker_that_fails_while_logging_stops_the_run_or_is_dropped(capsys):
    with pytest.raises(trackers.TrackerError, match="logger.backends: failing failed: OSError: disk full"):
        trackers.each([Failing()], LoggerConfig(), lambda t: t.log({"a": 1.0}, 1))
    assert trackers.each([Failing()], LoggerConfig(on_error="warn"), lambda t: t.log({"a": 1.0}, 1)) == []
    assert "failing failed: OSError: disk full; going on without it" in capsys.readouterr().out
    # closing (the run's end, a preemption after its checkpoint) never stops the run
    assert trackers.each([Failing()], LoggerConfig(), lambda t: t.log({"a": 1.0}, 1), closing=True) == []


@pytest.mark.heavy(cheap="tests/test_trackers.py::test_a_tracker_that_cannot_start_is_one_line_or_left_out")
def test_every_tracker_has_tensorboards_scalars_across_a_resume(tmp_path):
    model = save_tiny_hf_dir(tmp_path / "tiny")
    out, store = tmp_path / "grpo", tmp_path / "stores"
    env = {"WANDB_MODE": "offline", "WANDB_DIR": str(store / "wandb"), "WANDB_SILENT": "true",
           "MLFLOW_TRACKING_URI": f"sqlite:///{store / 'mlflow.db'}",  # MLflow's local store (its file store is in
           # maintenance mode, and cannot hold both reward/correctness and reward/correctness/scored)
           "TRACKIO_DIR": str(store / "trackio")}
    (store / "wandb").mkdir(parents=True)
    common = ["rollout.prompts_per_step=2", "rollout.group_size=4", "trainer.micro_batch_size=4", "data.heldout_size=4",
              "data.train_size=20", "rollout.max_tokens=8", "rollout.eval_max_tokens=6", "trainer.lr=1e-3",
              "trainer.progress_bar=false", "trainer.export_hf=false", "rollout.backend=megatron",
              "trainer.eval_every=2", "trainer.save_heldout_answers=true", "trainer.rollout_table_every=1",
              "logger.backends=[tensorboard, wandb, mlflow, trackio]", "logger.project=trackers_test"]
    first, resumed = run_jobs(  # one launch: steps 1-2, then the same output directory resumed for steps 3-4
        Job("grpo", model, out, [*common, "trainer.steps=2"], reward="even_length", env=env),
        Job("grpo", model, out, [*common, "trainer.steps=4"], reward="even_length", env=env,
            result=tmp_path / "resumed.json"))
    assert first["steps"] == 2 and resumed["start_step"] == 2 and resumed["steps"] == 4
    tensorboard = {tag: dict(points) for tag, points in read_scalars(out / "tensorboard").items()}
    assert set(tensorboard["reward/mean"]) == {1, 2, 3, 4} and {0, 2, 4} <= set(tensorboard["heldout/accuracy"])
    stored = {"wandb": wandb_offline(store / "wandb", trackers.WANDB_STEP),
              "mlflow": mlflow_runs(env["MLFLOW_TRACKING_URI"], "trackers_test"),
              "trackio": trackio_runs(store / "trackio", "trackers_test")}
    for backend, (ids, series) in stored.items():
        assert len(ids) == 1, (backend, ids)  # the resumed job continued the first one's run
        assert set(series) == set(tensorboard), (backend, set(series) ^ set(tensorboard))
        for tag, points in tensorboard.items():  # TensorBoard keeps float32
            assert {s: np.float32(v) for s, v in series[tag].items()} == {s: np.float32(v) for s, v in points.items()}, \
                (backend, tag)
    # the config as the run's parameters (a changed value cannot be one: the resumed job's is a tag), the held-out
    # answers and the rollout tables as artifacts
    from mlflow import MlflowClient

    client = MlflowClient(env["MLFLOW_TRACKING_URI"])
    [run_id] = stored["mlflow"][0]
    run = client.get_run(run_id)
    assert run.data.params["algorithm.name"] == "grpo" and run.data.params["trainer.steps"] == "2"
    assert run.data.tags["resumed.trainer.steps"] == "4"
    assert [f.path for f in client.list_artifacts(run_id, "rollouts")] == [
        f"rollouts/step_{s:06d}.jsonl" for s in (1, 2, 3, 4)]
    assert {"heldout/step_000000.jsonl", "heldout/step_000002.jsonl"} <= {
        f.path for f in client.list_artifacts(run_id, "heldout")}
    assert (store / "mlartifacts").is_dir()  # beside the SQLite database, not in the working directory
