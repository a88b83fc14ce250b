"""tools/plot_metrics.py: TensorBoard scalars are read back exactly and drawn to PNG files."""

from __future__ import annotations

import struct

import pytest
from torch.utils.tensorboard import SummaryWriter

from tools.plot_metrics import main, read_scalars

WRITTEN = {"reward/mean": [(1, 0.125), (2, 0.25), (3, 0.5)], "kl": [(1, 0.0), (2, 0.0078125), (3, 0.015625)],
           "heldout/accuracy": [(0, 0.5), (3, 0.625)], "loss/policy": [(1, -0.5), (2, -0.25), (3, 0.0)]}


def _png_size(path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", data[16:24])  # IHDR width, height


@pytest.fixture
def run_dir(tmp_path):
    writer = SummaryWriter(str(tmp_path / "run" / "tensorboard"))
    for tag, points in WRITTEN.items():
        for step, value in points:
            writer.add_scalar(tag, value, step)
    writer.close()
    return tmp_path / "run"


def test_scalars_read_back_exactly(run_dir):
    assert read_scalars(run_dir / "tensorboard") == WRITTEN  # values exact in float32


def test_default_tags_drawn_to_png(run_dir):
    paths = main([str(run_dir)])
    # the default tags the run has (no entropy / response_length here), then the overview
    assert [p.name for p in paths] == ["reward_mean.png", "kl.png", "heldout_accuracy.png", "metrics.png"]
    assert all(p.parent == run_dir / "plots" for p in paths)
    assert _png_size(paths[0]) == (500, 320)  # 5 x 3.2 inches at 100 dpi
    assert _png_size(paths[-1]) == (1500, 320)  # three side by side


def test_chosen_tags_and_unknown_tag(run_dir, tmp_path):
    paths = main([str(run_dir / "tensorboard"), "--out", str(tmp_path / "p"), "--tags", "loss/policy"])
    assert [p.name for p in paths] == ["loss_policy.png", "metrics.png"]
    with pytest.raises(ValueError, match=r"\['entropy'\] not in .*it has: heldout/accuracy, kl, loss/policy"):
        main([str(run_dir), "--tags", "entropy"])
    with pytest.raises(FileNotFoundError):
        main([str(tmp_path / "nothing")])
