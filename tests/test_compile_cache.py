"""vLLM's compile cache (alignment/rollout/engines/compile_cache.py): its key, the compiled-or-eager choice of
``rollout.enforce_eager=null``, a stand-in compile that is cold, then warm, then cold again for a changed shape,
and a compiled vLLM engine that answers the main job's prompts with the eager engine's greedy tokens."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from alignment.rollout.engines.compile_cache import BREAK_EVEN_STEPS, choose_enforce_eager, compile_cache, compile_key

ROOT = Path(__file__).resolve().parents[1]
SHAPE = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256}


def model_dir(path: Path, **changes) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({**SHAPE, **changes}))
    return path


def key(path: Path, **kw) -> str:
    args = {"dtype": "bfloat16", "max_model_len": 512, "vllm_version": "0.32.0", "torch_version": "2.13.0", **kw}
    return compile_key(path, **args)[0]


def test_the_key_changes_with_what_a_compiled_graph_depends_on_and_nothing_else(tmp_path):
    base = key(model_dir(tmp_path / "a"))
    # the same shape in another directory, another checkpoint's name and transformers version: the same graph
    assert key(model_dir(tmp_path / "b", _name_or_path="other", transformers_version="5.0.0")) == base
    assert key(model_dir(tmp_path / "c", hidden_size=128)) != base
    assert key(model_dir(tmp_path / "d", num_hidden_layers=3)) != base
    assert key(model_dir(tmp_path / "e", vocab_size=512)) != base
    assert key(tmp_path / "a", dtype="float32") != base
    assert key(tmp_path / "a", max_model_len=1024) != base
    assert key(tmp_path / "a", tensor_parallel_size=2) != base
    assert key(tmp_path / "a", vllm_version="0.33.0") != base
    assert key(tmp_path / "a", torch_version="2.14.0") != base
    assert len({base, key(tmp_path / "a", dtype="float32"), key(tmp_path / "a", vllm_version="0.33.0")}) == 3
    _, parts = compile_key(tmp_path / "a", dtype="bfloat16", max_model_len=512)
    assert parts["device"].startswith(("cpu:", "cuda:")) and parts["vllm"] and parts["torch"]
    if parts["device"].startswith("cpu:"):  # Inductor's CPU kernels are built for a thread count
        import torch

        threads = torch.get_num_threads()
        try:
            torch.set_num_threads(threads + 1)
            assert key(tmp_path / "a") != base
        finally:
            torch.set_num_threads(threads)
        assert key(tmp_path / "a") == base
    # a model vLLM resolves by name (no config.json) is keyed by the name
    assert key(tmp_path / "missing") != key(tmp_path / "missing2")


def test_the_cache_is_warm_only_after_a_compile_finished(tmp_path, monkeypatch):
    monkeypatch.setenv("MEGALIGN_CACHE", str(tmp_path / "cache"))
    for var in ("TORCHINDUCTOR_CACHE_DIR", "VLLM_CACHE_ROOT", "VLLM_USE_AOT_COMPILE"):
        monkeypatch.delenv(var, raising=False)
    cache = compile_cache(model_dir(tmp_path / "m"), dtype="float32", max_model_len=64)
    assert cache.path == tmp_path / "cache" / "compile" / cache.key and not cache.warm
    cache.activate()  # a compile starts: the variables point into the key's directory, the marker is not there yet
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(cache.path / "inductor")
    assert os.environ["VLLM_CACHE_ROOT"] == str(cache.path / "vllm") and os.environ["VLLM_USE_AOT_COMPILE"] == "0"
    assert not cache.warm
    cache.mark_complete(12.34)
    assert cache.warm and not list(cache.path.glob(".complete.*"))
    marker = json.loads((cache.path / "complete.json").read_text())
    assert marker["start_s"] == 12.3 and marker["model"]["hidden_size"] == 64 and marker["dtype"] == "float32"


def test_enforce_eager_null_compiles_on_a_gpu_or_when_the_run_pays_the_compile_back():
    assert choose_enforce_eager(True, warm=True, steps=1000, cuda=True)[0] is True  # set: kept
    assert choose_enforce_eager(False, warm=False, steps=1, cuda=False)[0] is False
    assert choose_enforce_eager(None, warm=False, steps=1, cuda=True)[0] is False  # a GPU: CUDA graphs
    cold, warm = BREAK_EVEN_STEPS["cold"], BREAK_EVEN_STEPS["warm"]
    assert warm < cold
    assert choose_enforce_eager(None, warm=False, steps=cold, cuda=False)[0] is False
    eager, why = choose_enforce_eager(None, warm=False, steps=cold - 1, cuda=False)
    assert eager is True and "cold" in why
    assert choose_enforce_eager(None, warm=True, steps=warm, cuda=False)[0] is False
    assert choose_enforce_eager(None, warm=True, steps=warm - 1, cuda=False)[0] is True
    assert choose_enforce_eager(None, warm=True, steps=None, cuda=False)[0] is True  # steps not known: eager


def _compile(model: Path, cache: Path) -> dict:
    env = {**os.environ, "MEGALIGN_CACHE": str(cache), "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)
    out = subprocess.run([sys.executable, str(ROOT / "tests/dist/compile_cache_worker.py"), str(model)], env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_a_compile_is_cold_then_warm_and_cold_again_for_a_changed_shape(tmp_path):
    """Fresh processes, as runs are: the first compiles (Inductor's FX-graph cache misses) into the key's
    directory; the second, same shape, finds it warm and loads the compiled graph (hits, no miss); a changed shape
    gets another directory and compiles again."""
    cache, model = tmp_path / "cache", model_dir(tmp_path / "m")
    first = _compile(model, cache)
    assert not first["warm"] and first["miss"] >= 1 and first["hit"] == 0
    assert Path(first["inductor_dir"]).is_dir() and Path(first["inductor_dir"]).parent.name == first["key"]
    second = _compile(model, cache)
    assert second["key"] == first["key"] and second["warm"] and second["hit"] >= 1 and second["miss"] == 0
    changed = _compile(model_dir(tmp_path / "m2", hidden_size=96), cache)
    assert changed["key"] != first["key"] and not changed["warm"] and changed["miss"] >= 1 and changed["hit"] == 0
    assert sorted(p.name for p in (cache / "compile").iterdir()) == sorted([first["key"], changed["key"]])


def _greedy(mode: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, str(ROOT / "tests/dist/vllm_greedy_worker.py"), mode, "16", "32"], env=env,
                         capture_output=True, text=True, timeout=900)
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    assert out.returncode == 0 and lines, out.stdout[-2000:] + out.stderr[-3000:]
    return json.loads(lines[-1][7:])


@pytest.mark.slow
@pytest.mark.heavy(
    cheap="tests/test_compile_cache.py::test_a_compile_is_cold_then_warm_and_cold_again_for_a_changed_shape")
def test_compiled_and_eager_vllm_give_the_same_greedy_tokens_on_the_main_jobs_prompts():
    """SmolLM2-135M-Instruct in fp32, 16 held-out arithmetic prompts of the main job, 32 greedy tokens each: the
    compiled engine (its compile cache in this test's private ``$MEGALIGN_CACHE``) answers token for token as the
    eager one does."""
    compiled, eager = _greedy("compiled"), _greedy("eager")
    assert compiled["compiled"] and not eager["compiled"], (compiled["note"], eager["note"])
    assert all(len(t) > 0 for t in eager["tokens"])
    assert compiled["tokens"] == eager["tokens"]
