"""The before-training held-out accuracy cache (alignment.trainers.eval_cache): evaluated once,
read back while nothing it depends on changes, recomputed when something does. The main job's
use of it: test_grpo_e2e.py (summary ``heldout_before_cached``)."""

from __future__ import annotations

import json
import os

import pytest

from alignment.trainers.eval_cache import (cache_key, cached_accuracy, lookup_accuracy, store_accuracy,
                                          weight_files_fingerprint)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MEGALIGN_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "heldout"


def test_evaluated_once_then_read_back(cache):
    calls = []

    def evaluate():
        calls.append(1)
        return 0.34

    assert cached_accuracy("k1", evaluate) == (0.34, False)
    assert json.loads((cache / "k1.json").read_text()) == {"accuracy": 0.34}
    assert cached_accuracy("k1", evaluate) == (0.34, True)
    assert len(calls) == 1
    assert cached_accuracy("k2", lambda: 0.5) == (0.5, False)  # another key: evaluated
    assert cached_accuracy("k1", lambda: 0.9, enabled=False) == (0.9, False)  # disabled: never read
    assert not list(cache.glob("*.tmp*"))  # atomic writes leave no temporary file


def test_looked_up_and_stored_apart(cache):
    # the evaluation run beside the first step (alignment/trainers/heldout.py) looks the key up before
    # training and stores the accuracy after the step
    assert lookup_accuracy("k") is None
    store_accuracy("k", 0.4, enabled=False)
    assert lookup_accuracy("k") is None and not cache.exists()
    store_accuracy("k", 0.4)
    assert lookup_accuracy("k") == 0.4 and lookup_accuracy("k", enabled=False) is None
    assert cached_accuracy("k", lambda: 0.9) == (0.4, True)


def test_damaged_entry_is_recomputed(cache):
    cache.mkdir(parents=True)
    (cache / "k.json").write_text("{not json")
    assert cached_accuracy("k", lambda: 0.25) == (0.25, False)
    assert cached_accuracy("k", lambda: 0.0) == (0.25, True)


def test_key_follows_the_weight_files(tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    with pytest.raises(FileNotFoundError, match="no weight file"):
        weight_files_fingerprint(ckpt)
    (ckpt / "model.safetensors").write_bytes(b"x" * 10)
    (ckpt / "config.json").write_text("{}")
    (ckpt / "README.md").write_text("not a weight")
    parts = {"weights": weight_files_fingerprint(ckpt), "dtype": "bfloat16"}
    assert [name for name, _, _ in parts["weights"]] == ["config.json", "model.safetensors"]
    key = cache_key(parts)
    assert cache_key(dict(reversed(list(parts.items())))) == key  # order of the parts does not matter
    assert cache_key({**parts, "dtype": "float32"}) != key
    os.utime(ckpt / "model.safetensors", ns=(1, 1))  # a rewritten checkpoint: new mtime
    assert cache_key({**parts, "weights": weight_files_fingerprint(ckpt)}) != key


def test_an_agents_accuracy_is_keyed_by_its_source(tmp_path, monkeypatch):
    """A held-out accuracy measured through an agent program is never taken for the engine's own, nor for
    another agent's, nor for the same agent's after an edit."""
    from alignment.trainers.eval_cache import agent_fingerprint

    pkg = tmp_path / "my_agents"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("async def run(base_url, row):\n    return None\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    first = agent_fingerprint("my_agents.a:run", None)
    assert first == agent_fingerprint("my_agents.a:run", None) and first.startswith("my_agents.a:run:")
    assert agent_fingerprint("my_agents.a:other", None) != first
    (pkg / "a.py").write_text("async def run(base_url, row):\n    return 1.0\n")
    assert agent_fingerprint("my_agents.a:run", None) != first
    assert agent_fingerprint(None, "python agent.py") == "command:python agent.py"


def test_an_openenv_environments_accuracy_is_keyed_by_its_apps_source_and_a_server_of_its_own_is_never_cached(
        tmp_path, monkeypatch):
    """An OpenEnv environment served from ``app`` is keyed by the app's module too (an edited game is evaluated
    again); one at a ``url`` can change unseen, so its held-out accuracy before training is measured every run."""
    from alignment.trainers.eval_cache import cacheable, hub_fingerprint
    from tests.test_config import cfg

    pkg = tmp_path / "my_games"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "server.py").write_text("app = None\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    client = "tests.openenv_envs:GuessEnv"
    first = hub_fingerprint("openenv", client, {"app": "my_games.server:app"})
    assert first != hub_fingerprint("openenv", client, {"url": "http://127.0.0.1:9"})
    (pkg / "server.py").write_text("app = 1\n")
    assert hub_fingerprint("openenv", client, {"app": "my_games.server:app"}) != first
    hub = ("rollout.environment=openenv", f"rollout.environment_id={client}")
    assert cacheable(cfg(*hub, "rollout.environment_args={app: 'tests.openenv_envs:app'}"))
    assert not cacheable(cfg(*hub, "rollout.environment_args={url: 'http://127.0.0.1:9'}"))
    assert cacheable(cfg())
