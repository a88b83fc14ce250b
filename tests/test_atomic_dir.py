"""Publishing a directory over an older one swaps them in one atomic step, so a kill at any moment
leaves one whole directory under the final name; where the filesystem cannot swap, nothing moves."""

from __future__ import annotations

import pytest

from parallel import atomic_dir


@pytest.fixture
def rank0(monkeypatch):
    monkeypatch.setattr(atomic_dir.dist, "barrier", lambda: None)
    monkeypatch.setattr(atomic_dir.dist, "get_rank", lambda: 0)


def make(path, text):
    path.mkdir()
    (path / "weights").write_text(text)
    return path


def test_exchange_swaps_two_directories(tmp_path):
    a, b = make(tmp_path / "a", "new"), make(tmp_path / "b", "old")
    assert atomic_dir.exchange(a, b)  # this machine's filesystem supports RENAME_EXCHANGE
    assert (a / "weights").read_text() == "old" and (b / "weights").read_text() == "new"
    with pytest.raises(FileNotFoundError):
        atomic_dir.exchange(tmp_path / "missing", b)


def test_a_step_written_again_replaces_the_old_one_whole(tmp_path, rank0, monkeypatch):
    tmp_path = tmp_path / "checkpoints"
    tmp_path.mkdir()
    final = make(tmp_path / "step_2", "old")
    atomic_dir.publish(make(tmp_path / "step_2.tmp", "new"), final)
    assert (final / "weights").read_text() == "new" and sorted(p.name for p in tmp_path.iterdir()) == ["step_2"]
    assert atomic_dir.MANIFEST in {p.name for p in final.iterdir()}
    swaps = []
    real = atomic_dir.exchange

    def killed_after_the_swap(a, b):  # the swap done, the kill before the old one is removed
        swaps.append(real(a, b))
        raise KeyboardInterrupt
    monkeypatch.setattr(atomic_dir, "exchange", killed_after_the_swap)
    with pytest.raises(KeyboardInterrupt):
        atomic_dir.publish(make(tmp_path / "step_2.tmp2", "newer"), final)
    assert swaps == [True] and (final / "weights").read_text() == "newer"  # whole, the new one
    # a filesystem that cannot swap: moved aside, then renamed (the old path)
    monkeypatch.setattr(atomic_dir, "exchange", lambda a, b: False)
    atomic_dir.publish(make(tmp_path / "step_2.tmp3", "newest"), final)
    assert (final / "weights").read_text() == "newest" and not (tmp_path / "step_2.old").exists()
