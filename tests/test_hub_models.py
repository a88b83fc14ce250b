"""Models by Hub id (``model.path=ORG/NAME``, and every other model a job loads): resolved through
``huggingface_hub.snapshot_download`` into the Hub's own cache, honouring ``HF_HOME``, ``HF_HUB_OFFLINE``
and ``model.revision``, downloaded once per node under a file lock while the other ranks wait; offline
and not cached, one line naming the id and the command that fetches it. Tested offline with a cache this
test builds in the library's own layout (``models--org--name/{refs,snapshots}``)."""

from __future__ import annotations

import shutil
import threading
import time
from pathlib import Path

import pytest

from alignment.models.hf_assets import hub_cache, is_hub_id, prepare_hf_dir
from tests.dist.tiny_llama import save_tiny_hf_dir
from tools import cli

COMMIT = "0123456789abcdef0123456789abcdef01234567"
OTHER = "fedcba9876543210fedcba9876543210fedcba98"


def build_cache(hf_home: Path, repo: str, model_dir: Path, refs: dict[str, str]) -> Path:
    """``model_dir`` as the Hub's cache holds a download of ``repo``: the files under
    ``snapshots/<commit>`` and each ref (branch) -> commit under ``refs/``."""
    root = hf_home / "hub" / ("models--" + repo.replace("/", "--"))
    for ref, commit in refs.items():
        snap = root / "snapshots" / commit
        if not snap.exists():
            shutil.copytree(model_dir, snap)
        (root / "refs").mkdir(parents=True, exist_ok=True)
        (root / "refs" / ref).write_text(commit)
    return root


@pytest.fixture()
def offline_hub(tmp_path, monkeypatch):
    home = tmp_path / "hf_home"
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return home


def test_a_hub_id_resolves_offline_from_the_cache_at_its_revision(tmp_path, offline_hub):
    tiny = save_tiny_hf_dir(tmp_path / "tiny")
    root = build_cache(offline_hub, "Acme/Tiny-Llama", tiny, {"main": COMMIT, "v2": OTHER})
    assert is_hub_id("Acme/Tiny-Llama") and not is_hub_id(str(tiny)) and not is_hub_id("smollm2")
    assert hub_cache() == offline_hub / "hub"
    assert prepare_hf_dir("Acme/Tiny-Llama") == root / "snapshots" / COMMIT
    assert prepare_hf_dir("Acme/Tiny-Llama", revision="v2") == root / "snapshots" / OTHER
    assert prepare_hf_dir("Acme/Tiny-Llama@v2") == root / "snapshots" / OTHER
    assert prepare_hf_dir("Acme/Tiny-Llama", revision=OTHER) == root / "snapshots" / OTHER
    with pytest.raises(FileNotFoundError) as info:
        prepare_hf_dir("Acme/Not-Here")
    assert str(info.value).startswith("model.path=Acme/Not-Here: not in the Hugging Face cache ") and \
        "HF_HUB_OFFLINE is set; fetch it where the Hub is reachable with `hf download Acme/Not-Here`" in str(info.value)
    with pytest.raises(FileNotFoundError, match="hf download Acme/Tiny-Llama --revision v9"):
        prepare_hf_dir("Acme/Tiny-Llama", revision="v9")


def test_a_job_takes_every_model_by_hub_id(tmp_path, offline_hub, capsys):
    """``megalign train --dry-run`` of a PPO job whose policy, critic and reward model are Hub ids, and a
    distillation job whose teacher is one: the same checks as on local directories."""
    tiny = save_tiny_hf_dir(tmp_path / "tiny")
    build_cache(offline_hub, "Acme/Tiny-Llama", tiny, {"main": COMMIT})
    out = tmp_path / "out"
    assert cli.main(["train", "--nproc", "2", "--dry-run", "--config-name", "ppo", "model.path=Acme/Tiny-Llama",
                     "model.critic_path=Acme/Tiny-Llama", "model.reward_model_path=Acme/Tiny-Llama",
                     f"output_dir={out}"]) == 0
    text = capsys.readouterr().out
    assert f"model {offline_hub / 'hub' / 'models--Acme--Tiny-Llama' / 'snapshots' / COMMIT}" in text.splitlines()[-1]
    assert cli.main(["train", "--nproc", "2", "--dry-run", "--config-name", "distill", "model.path=Acme/Tiny-Llama",
                     "model.teacher_path=Acme/Tiny-Llama", "model.revision=main", f"output_dir={out}"]) == 0
    capsys.readouterr()
    assert cli.main(["train", "--nproc", "2", "--dry-run", "--config-name", "distill", "model.path=Acme/Tiny-Llama",
                     "model.teacher_path=Acme/Gone", f"output_dir={out}"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("megalign: error: model.teacher_path=Acme/Gone: not in the Hugging "
                                               "Face cache") and "`hf download Acme/Gone`" in err[0]
    assert not out.exists()


def test_the_ranks_of_a_node_download_once(tmp_path, monkeypatch):
    """Online: the first process to take the cache's file lock downloads, the others wait and find the
    snapshot (a stand-in ``snapshot_download`` that takes 0.3 s and counts its downloads)."""
    import huggingface_hub

    tiny = save_tiny_hf_dir(tmp_path / "tiny")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    downloads = []

    def fake(repo, *, revision=None, cache_dir=None, local_files_only=False, allow_patterns=None, **_):
        root = Path(cache_dir) / ("models--" + repo.replace("/", "--"))
        if not (root / "refs" / "main").exists():
            assert not local_files_only and "*.safetensors" in allow_patterns
            time.sleep(0.3)
            downloads.append(repo)
            build_cache(Path(cache_dir).parent, repo, tiny, {"main": COMMIT})
        return str(root / "snapshots" / COMMIT)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake)
    found = []
    ranks = [threading.Thread(target=lambda: found.append(prepare_hf_dir("Acme/Tiny-Llama"))) for _ in range(4)]
    for r in ranks:
        r.start()
    for r in ranks:
        r.join()
    assert downloads == ["Acme/Tiny-Llama"] and len(set(found)) == 1 and len(found) == 4
