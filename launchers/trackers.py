"""Experiment trackers beside TensorBoard (``logger.backends``: ``wandb``, ``mlflow``, ``trackio``), as verl's
``trainer.logger`` and TRL's ``report_to`` have them. Each gets every scalar the run writes to TensorBoard with the
same names and steps (:meth:`launchers.common.Run.log`), the resolved config as the run's parameters, and the
rollout and held-out tables. Rank 0 alone talks to them, as it alone writes TensorBoard.

A resumed run continues the same tracker run: each backend's run id is written into every checkpoint
(:data:`IDS_FILE`) and read back from the one the run resumes from (:func:`start`). Steps logged after that
checkpoint by the run that was killed are logged again by the resumed one, as TensorBoard has them; W&B keeps its
own step counter for that (``_step``, which only grows) and charts by ``train/step``, which is the run's step.

Each backend reads its own settings from the environment: W&B ``WANDB_MODE`` (``offline``: no server),
``WANDB_DIR`` (default: the output directory), ``WANDB_ENTITY``, ``WANDB_API_KEY``; MLflow ``MLFLOW_TRACKING_URI``;
Trackio ``TRACKIO_DIR``. ``logger.project`` names the W&B project, the MLflow experiment and the Trackio project
(null: ``WANDB_PROJECT`` / ``MLFLOW_EXPERIMENT_NAME``, else ``megalign``; Trackio: ``megalign``).
"""

from __future__ import annotations

import json
import os
import re
import secrets
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from alignment.config import LoggerConfig
from alignment.schema import ConfigError

#: the checkpoint file that holds each backend's run id
IDS_FILE = "trackers.json"
#: the x-axis W&B charts a run's scalars by (its own ``_step`` only grows, and a resumed run repeats steps)
WANDB_STEP = "train/step"


class TrackerError(RuntimeError):
    """A tracker that cannot start or write: the one line said, naming ``logger.backends`` and the fix."""


class Tracker(Protocol):
    """One backend's run."""

    #: its ``logger.backends`` name
    name: str
    #: what resumes it (:data:`IDS_FILE`)
    run_id: str

    def log(self, values: dict[str, float], step: int) -> None:
        """Scalars at ``step``."""

    def log_rows(self, name: str, rows: list[dict[str, Any]], step: int) -> None:
        """A table (one dict per row) named ``name`` at ``step``."""

    def close(self) -> None:
        """End the run (it stays resumable)."""


def _project(c: LoggerConfig, env: str | None = None) -> str:
    return c.project or (os.environ.get(env) if env else None) or "megalign"


def _cell(value: Any) -> Any:
    """A table cell: numbers, strings and booleans as they are, anything else as JSON."""
    return value if value is None or isinstance(value, (int, float, str, bool)) else json.dumps(value)


def _columns(rows: list[dict[str, Any]]) -> list[str]:
    return list(dict.fromkeys(k for r in rows for k in r))


def flat_params(config: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """``config`` (nested dicts) as ``{"section.key": "value"}``, values as text (lists as JSON)."""
    out: dict[str, str] = {}
    for k, v in config.items():
        if isinstance(v, dict):
            out.update(flat_params(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = json.dumps(v) if isinstance(v, (list, tuple)) else str(v)
    return out


class WandbTracker:
    """A Weights & Biases run (``wandb.init(id=..., resume="allow")``)."""

    name = "wandb"

    def __init__(self, c: LoggerConfig, run_name: str, run_id: str | None, config: dict[str, Any], out: Path):
        import wandb

        self.wandb = wandb
        self.run = wandb.init(project=_project(c, "WANDB_PROJECT"), name=run_name, id=run_id,
                              resume="allow", config=config, dir=os.environ.get("WANDB_DIR", str(out)))
        self.run.define_metric(WANDB_STEP)
        self.run.define_metric("*", step_metric=WANDB_STEP)
        self.run_id = str(self.run.id)

    def log(self, values: dict[str, float], step: int) -> None:
        self.run.log({**values, WANDB_STEP: step})

    def log_rows(self, name: str, rows: list[dict[str, Any]], step: int) -> None:
        columns = _columns(rows)
        table = self.wandb.Table(columns=columns, data=[[_cell(r.get(c)) for c in columns] for r in rows])
        self.run.log({name: table, WANDB_STEP: step})

    def close(self) -> None:
        self.run.finish()


def mlflow_name(key: str) -> str:
    """``key`` as MLflow takes a metric's name (letters, digits, ``_ - . / :`` and spaces): ``@`` as ``_at_``
    (``heldout/pass@4`` -> ``heldout/pass_at_4``), anything else outside the set as ``_``."""
    return re.sub(r"[^\w\-./: ]", "_", key.replace("@", "_at_"))


class MlflowTracker:
    """An MLflow run (``MlflowClient``: the tracking server or store of ``MLFLOW_TRACKING_URI``; a local SQLite
    store keeps the artifacts beside its database, in ``mlartifacts/``, as ``mlflow server`` does). Metric names
    as :func:`mlflow_name` gives them."""

    name = "mlflow"
    #: MLflow's limits per ``log_batch`` call
    BATCH_PARAMS, BATCH_METRICS = 100, 1000

    def __init__(self, c: LoggerConfig, run_name: str, run_id: str | None, config: dict[str, Any], out: Path):
        from mlflow import MlflowClient
        from mlflow.entities import Metric, Param

        self.Metric = Metric
        reachable(os.environ.get("MLFLOW_TRACKING_URI", ""))
        self.client = MlflowClient()
        if run_id:
            self.run_id = run_id
            self.client.update_run(run_id, status="RUNNING")
            known = self.client.get_run(run_id).data.params
        else:
            name = _project(c, "MLFLOW_EXPERIMENT_NAME")
            experiment = self.client.get_experiment_by_name(name)
            uri = self.client.tracking_uri
            artifacts = str(Path(uri[len("sqlite:///"):]).parent / "mlartifacts") if uri.startswith("sqlite:///") else None
            experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(
                name, artifact_location=artifacts)
            self.run_id = self.client.create_run(experiment_id, run_name=run_name).info.run_id
            known = {}
        # a param's value cannot change: a resumed run's new keys are added, a changed value is a tag
        params = flat_params(config)
        new = [Param(k, v[:6000]) for k, v in params.items() if k not in known]
        for i in range(0, len(new), self.BATCH_PARAMS):
            self.client.log_batch(self.run_id, params=new[i: i + self.BATCH_PARAMS])
        for k, v in params.items():
            if k in known and known[k] != v[:6000]:
                self.client.set_tag(self.run_id, f"resumed.{k}", v[:5000])

    def log(self, values: dict[str, float], step: int) -> None:
        now = int(time.time() * 1000)
        metrics = [self.Metric(mlflow_name(k), float(v), now, step) for k, v in values.items()]
        for i in range(0, len(metrics), self.BATCH_METRICS):
            self.client.log_batch(self.run_id, metrics=metrics[i: i + self.BATCH_METRICS])

    def log_rows(self, name: str, rows: list[dict[str, Any]], step: int) -> None:
        self.client.log_text(self.run_id, "".join(json.dumps(r) + "\n" for r in rows), f"{name}/step_{step:06d}.jsonl")

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


class TrackioTracker:
    """A Trackio run (its local store, ``TRACKIO_DIR``, or a Space), named ``<run_name>-<6 hex>``: Trackio knows
    runs by name, so a new run of the same ``run_name`` must not resume an old one."""

    name = "trackio"

    def __init__(self, c: LoggerConfig, run_name: str, run_id: str | None, config: dict[str, Any], out: Path):
        import trackio

        self.trackio = trackio
        self.run_id = run_id or f"{run_name}-{secrets.token_hex(3)}"
        # its own CPU / GPU metrics off: what it stores is what TensorBoard has
        trackio.init(project=_project(c), name=self.run_id, config=config,
                     resume="must" if run_id else "never", auto_log_cpu=False, auto_log_gpu=False)

    def log(self, values: dict[str, float], step: int) -> None:
        self.trackio.log(dict(values), step=step)

    def log_rows(self, name: str, rows: list[dict[str, Any]], step: int) -> None:
        columns = _columns(rows)
        self.trackio.log({name: self.trackio.Table(columns=columns, data=[[_cell(r.get(c)) for c in columns]
                                                                            for r in rows])}, step=step)

    def close(self) -> None:
        self.trackio.finish()


#: ``logger.backends`` name -> its tracker
TRACKERS: dict[str, Callable[..., Tracker]] = {"wandb": WandbTracker, "mlflow": MlflowTracker,
                                               "trackio": TrackioTracker}


def reachable(uri: str, timeout_s: float = 10.0) -> None:
    """Raise :class:`TrackerError` when the HTTP tracking server ``uri`` does not answer within ``timeout_s``
    (a client's own retries would wait minutes); other URIs (a local store) are not checked."""
    if not uri.startswith(("http://", "https://")):
        return
    try:
        urllib.request.urlopen(uri.rstrip("/") + "/health", timeout=timeout_s).close()
    except urllib.error.HTTPError:  # it answered (an auth proxy's 401, say): the client's requests will tell
        return
    except OSError as e:
        raise TrackerError(f"MLFLOW_TRACKING_URI={uri} does not answer ({e})") from e


def check_servers(c: LoggerConfig) -> None:
    """Before any process starts (rank 0): with ``mlflow`` in ``logger.backends``, its tracking URI is not the
    file store, and a server there answers (W&B's and Trackio's own clients say when theirs do not).

    Raises:
        ConfigError: naming it and the fix (``logger.on_error=fail``; ``warn``: said when the tracker starts)."""
    if "mlflow" not in c.backends or os.environ.get("RANK", "0") != "0":  # rank 0 alone talks to it
        return
    import mlflow

    uri = mlflow.get_tracking_uri()  # MLFLOW_TRACKING_URI, or MLflow's default
    if uri.startswith("file:") or "://" not in uri:
        raise ConfigError(f"logger.backends has mlflow, but its tracking URI {uri} is MLflow's file store, which "
                          "cannot hold a run's reward/<term> beside reward/<term>/scored: set MLFLOW_TRACKING_URI to "
                          "a server or to sqlite:///<path>/mlflow.db")
    if c.on_error != "fail":
        return
    try:
        reachable(uri)
    except TrackerError as e:
        raise ConfigError(f"logger.backends has mlflow, but {e}: start the server or fix the URI, or set "
                          "logger.on_error=warn to go on without it") from e


def saved_ids(checkpoint: Path | None) -> dict[str, str]:
    """The run ids written into ``checkpoint`` (:data:`IDS_FILE`, or in its first part's folder for a checkpoint
    of several models, e.g. PPO's policy and critic); empty without one."""
    if checkpoint is None:
        return {}
    found = [Path(checkpoint) / IDS_FILE, *sorted(Path(checkpoint).glob(f"*/{IDS_FILE}"))]
    return next((json.loads(p.read_text()) for p in found if p.is_file()), {})


def start(c: LoggerConfig, run_name: str, config: dict[str, Any], out: Path, resumed: Path | None
          ) -> list[Tracker]:
    """The trackers of ``logger.backends`` (TensorBoard aside), each resuming the run the checkpoint ``resumed``
    names. One that cannot start raises :class:`TrackerError` (``logger.on_error=fail``), or is left out with one
    line saying so (``warn``)."""
    ids, trackers = saved_ids(resumed), []
    for name in c.backends:
        if name not in TRACKERS:
            continue
        try:
            trackers.append(TRACKERS[name](c, run_name, ids.get(name), config, out))
        except Exception as e:  # the backend's own errors: an import, a refused key, an unreachable server
            line = f"logger.backends: {name} did not start: {type(e).__name__}: {e}"
            if c.on_error == "fail":
                raise TrackerError(f"{line} (logger.on_error=warn goes on without it)") from e
            print(f"{line}; going on without it (logger.on_error=warn)", flush=True)
    return trackers


def each(trackers: list[Tracker], c: LoggerConfig, call: Callable[[Tracker], None], closing: bool = False
         ) -> list[Tracker]:
    """``call`` on every tracker; returns those still working: one that raises stops the run
    (:class:`TrackerError`, ``logger.on_error=fail``) or is dropped with one line (``warn``, and always while
    ``closing``: a run that ends, or is preempted after its checkpoint, ends as it would without trackers)."""
    kept = []
    for t in trackers:
        try:
            call(t)
            kept.append(t)
        except Exception as e:  # the backend's own errors
            line = f"logger.backends: {t.name} failed: {type(e).__name__}: {e}"
            if c.on_error == "fail" and not closing:
                raise TrackerError(f"{line} (logger.on_error=warn goes on without it)") from e
            print(f"{line}; going on without it (logger.on_error=warn)", flush=True)
    return kept
