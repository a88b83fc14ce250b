"""Reading back what the experiment trackers stored locally (tests/test_trackers.py): each gives ``(run ids,
{metric: {step: value}})``, the later value where a step was logged twice (as TensorBoard shows it)."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

#: W&B's run files: a 7-byte header, then LevelDB log records in 32 KiB blocks (checksum, length, type), each
#: record or its fragments a protobuf ``Record`` (wandb's ``internal/datastore`` format; wandb 0.31 has no Python
#: reader of its own)
WANDB_BLOCK, WANDB_HEADER, FULL, FIRST, MIDDLE, LAST = 32768, 7, 1, 2, 3, 4


def wandb_records(path: Path):
    """The protobuf records of one ``run-<id>.wandb`` file, in order."""
    from wandb.proto import wandb_internal_pb2

    data = Path(path).read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B run file"
    pos, parts = WANDB_HEADER, b""
    while pos + 7 <= len(data):
        left = WANDB_BLOCK - pos % WANDB_BLOCK
        if left < 7:  # a block's tail too short for a header is padding
            pos += left
            continue
        _checksum, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if length == 0 and kind == 0:  # zero padding to the block's end
            pos += left
            continue
        parts += data[pos + 7: pos + 7 + length]
        pos += 7 + length
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(parts)
            parts = b""
            yield record


def wandb_offline(wandb_dir: Path, step_key: str) -> tuple[set[str], dict[str, dict[int, float]]]:
    """Every offline run under ``wandb_dir/wandb``: their run ids and scalars by the ``step_key`` each row holds."""
    ids, series = set(), {}
    for run_dir in sorted(Path(wandb_dir, "wandb").glob("offline-run-*"), key=lambda p: p.stat().st_mtime):
        for record in wandb_records(next(run_dir.glob("run-*.wandb"))):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                ids.add(record.run.run_id)
            elif kind == "history":
                row = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
                tables = {k[: -len("/_type")] + "/" for k in row if k.endswith("/_type")}  # a table's own fields
                for k, v in row.items():
                    if any(k.startswith(t) for t in tables):
                        continue
                    if not k.startswith("_") and k != step_key and isinstance(v, (int, float)):
                        series.setdefault(k, {})[int(row[step_key])] = float(v)
    return ids, series


def mlflow_runs(tracking_uri: str, experiment: str) -> tuple[set[str], dict[str, dict[int, float]]]:
    """The runs of ``experiment`` and the first one's metric histories."""
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri)
    runs = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    series = {}
    for key in runs[0].data.metrics:
        for m in sorted(client.get_metric_history(runs[0].info.run_id, key), key=lambda m: m.timestamp):
            series.setdefault(key, {})[m.step] = m.value
    return {r.info.run_id for r in runs}, series


def trackio_runs(trackio_dir: Path, project: str) -> tuple[set[str], dict[str, dict[int, float]]]:
    """The runs of ``project`` in Trackio's local store at ``trackio_dir`` and the first one's logs (read in a
    process of its own: Trackio takes ``TRACKIO_DIR`` once, when it is imported)."""
    read = ("import json, sys; from trackio.sqlite_storage import SQLiteStorage as S; runs = S.get_runs(sys.argv[1]); "
            "print(json.dumps([runs, S.get_logs(sys.argv[1], runs[0]) if runs else []], default=str))")
    out = subprocess.run([sys.executable, "-c", read, project], env={**os.environ, "TRACKIO_DIR": str(trackio_dir)},
                         capture_output=True, text=True, check=True).stdout
    runs, logs = json.loads(out.strip().splitlines()[-1])
    series: dict[str, dict[int, float]] = {}
    for row in logs:
        for k, v in row.items():
            if k not in ("step", "timestamp") and isinstance(v, (int, float)):
                series.setdefault(k, {})[int(row["step"])] = float(v)
    return set(runs), series
