"""tools/profile_step.py: a real 2-process SFT job with profiling on writes torch.profiler traces
of the chosen step on both ranks, and the report's phase times, tokens/s, MFU and memory come
from the run; the FLOPs per token are checked by hand."""

from __future__ import annotations

import json

import pytest

from alignment.models.families import model_dims
from alignment.models.flops import flops_per_token, matmul_params
from tests.dist.tiny_llama import save_tiny_hf_dir, tiny_llama_config


def test_flops_per_token_by_hand():
    d = model_dims(tiny_llama_config())  # L=4, h=64, 4 heads / 2 KV of 32, ffn 80, vocab 250
    per_layer = 64 * 32 * (4 + 2 + 2 + 4) + 3 * 64 * 80  # q, k, v, o + gate, up, down = 24576 + 15360
    assert matmul_params(d) == 4 * per_layer + 250 * 64 == 175_744
    # forward: 2 N + causal attention 2 L H d T at T = 10
    assert flops_per_token(d, 10, training=False) == 2 * 175_744 + 2 * 4 * 4 * 32 * 10 == 361_728
    assert flops_per_token(d, 10) == 3 * 361_728
    # the output layer (250 x 64) on a quarter of the tokens only
    assert flops_per_token(d, 10, training=False, output_fraction=0.25) == 361_728 - 2 * 250 * 64 * 0.75
    with pytest.raises(ValueError, match="seq_length=0: must be > 0"):
        flops_per_token(d, 0)
    with pytest.raises(ValueError, match="output_fraction=1.5"):
        flops_per_token(d, 10, output_fraction=1.5)


def test_mfu_counts_each_steps_own_tokens_when_step_times_vary():
    """256 tokens a step at 1 s and 3 s (the first step skipped as warm-up): 256 tokens a step, where the mean
    rate x the mean time gives (256 + 85.3) / 2 x 2 = 341.3. 1 s of training a step: 256 x FLOPs per token."""
    from types import SimpleNamespace

    from tools.profile_step import mfu

    rows = [{"tokens_per_s": 256 / s, "time/step": s, "time/train": 1.0, "seq_length": 10.0} for s in (9.0, 1.0, 3.0)]
    cfg = SimpleNamespace(algorithm=SimpleNamespace(name="sft", ppo_epochs=1))
    m = mfu({"history": rows}, cfg, tiny_llama_config(), peak_flops=1e9)
    assert m["tokens_per_step"] == pytest.approx(256.0, rel=1e-12)
    assert m["achieved_flops"] == pytest.approx(256 * flops_per_token(model_dims(tiny_llama_config()), 10.0))


@pytest.mark.heavy(cheap="tests/test_profile_step.py::test_flops_per_token_by_hand")
def test_profile_step_traces_and_reports_a_real_run(tmp_path):
    from tools.profile_step import main, report

    save_tiny_hf_dir(tmp_path / "tiny")
    out = tmp_path / "sft"
    rc = main(["--nproc", "2", "--steps", "2", "--ranks", "0", "1", "--",
               "--config-name", "sft", f"model.path={tmp_path / 'tiny'}", f"output_dir={out}",
               "data.max_length=64", "data.max_prompt_length=32", "trainer.progress_bar=false",
               "data.train_size=16", "data.heldout_size=8", "trainer.global_batch_size=4",
               "trainer.micro_batch_size=2", "trainer.steps=3", "trainer.save_every=2"])
    assert rc == 0
    summary = json.loads((out / "summary.json").read_text())
    text, n = report(out, peak=(1e11, "fixed 100 GFLOP/s"))

    # one Chrome trace per traced rank, for step 2 only, full of real aten matmuls
    assert len(n["traces"]) == 2 and all("_step2." in t for t in n["traces"])
    assert {f"rank{r}_step2" for r in (0, 1)} == {t.rsplit("/", 1)[1].split(".")[0] for t in n["traces"]}
    for t in n["traces"]:
        events = json.load(open(t))["traceEvents"]
        assert sum(e.get("name") == "aten::mm" for e in events) > 10
    # phases: steps 2 and 3 averaged; checkpoints at step 2 (save_every) and the final step 3
    steady = summary["history"][1:]
    assert n["phases"]["train"] == pytest.approx(sum(h["time/train"] for h in steady) / 2)
    assert summary["phase_timers"]["checkpoint"]["count"] == 2 and n["phases"]["checkpoint"] > 0
    assert n["tokens_per_s"] == pytest.approx(sum(h["tokens_per_s"] for h in steady) / 2)
    # 4 examples of at most 64 tokens per step
    m = n["mfu"]
    assert 4 * 16 < m["tokens_per_step"] <= 4 * 64
    assert m["mfu"] == pytest.approx(m["achieved_flops"] / 1e11) and 0 < m["mfu"] < 1
    assert [r["rank"] for r in n["memory"]] == [0, 1] and all(0.2 < r["peak_rss_gib"] < 8 for r in n["memory"])
    assert "| train |" in text and "MFU (training phase)" in text and "fixed 100 GFLOP/s" in text


def test_report_refuses_a_directory_without_a_run(tmp_path):
    from tools.profile_step import report

    with pytest.raises(FileNotFoundError, match="summary.json not found"):
        report(tmp_path)
